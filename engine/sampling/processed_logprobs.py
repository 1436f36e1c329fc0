"""Log probabilities from the distribution a row actually drew from
(SamplingParams.logprobs_mode "processed": llama.cpp's post_sampling_probs).

RowLogprobs (engine/sampling/logprobs.py) takes the raw log_softmax of every
asking row before the sampler touches the logits. After the draw, the rows
in processed mode get theirs replaced, on the device, by the sampler's final
distribution (logit bias, penalties, grammar mask, temperature, top-k, top-p,
min-p; cut tokens at -inf, so they rank last among the alternatives). Rows
in raw mode, and rows that did not ask, cost nothing more; the named token
ids' log probabilities stay raw.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.sampling.logprobs import RowLogprobs
from engine.sampling.sampler import Sampler
from engine.scheduling.sequence import Sequence


def use_processed(asked: RowLogprobs | None, logits: torch.Tensor, seqs: Seq[Sequence],
                  sampler: Sampler) -> None:
    """For logits [N, vocab] of seqs as the sampler left them (biased, masked
    and penalised in place) and asked, the raw log probabilities of those
    rows: replace the processed-mode rows' values and top alternatives."""
    if asked is None:
        return
    picks = [i for i, row in enumerate(asked.rows)
             if seqs[row].params.logprobs_mode == "processed"]
    if not picks:
        return
    rows = [asked.rows[i] for i in picks]
    chosen = logits if len(rows) == len(seqs) else logits.index_select(0, _index(rows, logits))
    final = sampler.final_logprobs(chosen, [seqs[row] for row in rows])
    where = _index(picks, logits)
    asked.logprobs.index_copy_(0, where, final)
    if asked.top is not None:
        values, ids = asked.top
        top = final.topk(values.shape[1], dim=-1)
        values.index_copy_(0, where, top.values)
        ids.index_copy_(0, where, top.indices)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).to(like.device, non_blocking=True)
