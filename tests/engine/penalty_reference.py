"""The penalties as the sampler applied them before they moved to the device
(engine/sampling/penalty_state.py): one row at a time, with torch ops over
the row's tokens read on the host. The tests hold the device state to it."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from engine.sampling.penalty_state import AppliedPenalties, Resolve
from engine.sampling.sampler import Sampler
from engine.scheduling.sequence import SeqStatus, Sequence

CPU = torch.device("cpu")


def host_tokens(seq: Sequence, resolve: Resolve | None,
                device: torch.device = CPU) -> list[int]:
    """seq's token ids with placeholders read from the device (a host sync)."""
    if not seq.has_pending_token:
        return list(seq.token_ids)
    assert resolve is not None
    return resolve(torch.tensor(seq.token_ids, dtype=torch.int64, device=device)).tolist()


def reference_penalties(logits: torch.Tensor, seqs: Seq[Sequence],
                        tokens_of: Callable[[Sequence], list[int]]) -> None:
    """Penalise logits [N, vocab] in place, row i by seqs[i]'s tokens."""
    for row, seq in enumerate(seqs):
        params = seq.params
        if not params.has_penalties:
            continue
        tokens = tokens_of(seq)
        window = params.penalty_last_n
        recent = tokens[-window:] if window > 0 else tokens
        if params.repetition_penalty != 1.0:
            # Prompt and output tokens alike: positive logits divided, negative multiplied.
            seen = torch.tensor(sorted(set(recent)), device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / params.repetition_penalty,
                                            values * params.repetition_penalty)
        # OpenAI: generated tokens only; with a window (llama.cpp) the context's last tokens.
        output = recent if window > 0 else tokens[seq.num_prompt_tokens:]
        if output and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(torch.tensor(output, device=logits.device),
                                    minlength=logits.shape[1]).to(logits.dtype)
            logits[row] -= counts * params.frequency_penalty
            logits[row] -= (counts > 0).to(logits.dtype) * params.presence_penalty


class HostPenaltySampler(Sampler):
    """A Sampler that penalises as reference_penalties does, keeping nothing on the device."""

    def _penalise(self, logits: torch.Tensor, seqs: Seq[Sequence],
                  resolve: Resolve | None) -> AppliedPenalties | None:
        reference_penalties(logits, seqs, lambda seq: host_tokens(seq, resolve, self.device))
        return None


class CheckedSampler(Sampler):
    """A Sampler that checks, at every step, the device state's penalised
    logits against reference_penalties, computed on the CPU over the tokens
    read on the host: equal bit for bit, or within `tolerance` (relative and
    absolute) on a GPU. Counts the penalty rows and those sampled with
    their newest token still on the device."""

    def __init__(self, *args: object, tolerance: float = 0.0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tolerance = tolerance
        self.rows = self.rows_ahead = 0

    def _penalise(self, logits: torch.Tensor, seqs: Seq[Sequence],
                  resolve: Resolve | None) -> AppliedPenalties | None:
        # A finished row's token is dropped: the device leaves it unpenalised.
        live = [row for row, seq in enumerate(seqs) if seq.status is not SeqStatus.FINISHED]
        want = logits[live].cpu()
        reference_penalties(want, [seqs[row] for row in live],
                            lambda seq: host_tokens(seq, resolve, self.device))
        applied = super()._penalise(logits, seqs, resolve)
        torch.testing.assert_close(logits[live].cpu(), want, rtol=self.tolerance,
                                   atol=self.tolerance)
        penalised = [seqs[row] for row in live if seqs[row].params.has_penalties]
        self.rows += len(penalised)
        self.rows_ahead += sum(1 for seq in penalised if seq.has_pending_token)
        return applied
