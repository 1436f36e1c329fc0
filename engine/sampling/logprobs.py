"""Log probabilities of sampled tokens, for the rows of a step that ask.

They come from the model's own distribution: log_softmax of the raw logits,
taken before the sampler adds a logit_bias, applies penalties, masks a
grammar's forbidden tokens or divides by the temperature (vLLM's default
"raw_logprobs"; what OpenAI's clients compare across requests). A step
computes them only for its rows with SamplingParams.logprobs >= 0, on the
logits' device, and copies them to the host with the sampled tokens: a row
that did not ask costs nothing. A row may also name token ids whose log
probabilities it wants at each sampled position (a rerank judge's "yes" and
"no"): a gather from the same log_softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.scheduling.sequence import Sequence
from protocol import TokenLogprobs


@dataclass
class RowLogprobs:
    """log_softmax of the asking rows, taken before sampling changes the logits."""

    rows: list[int]  # indices among the sampled rows
    counts: list[int]  # alternatives each row asked for
    logprobs: torch.Tensor  # float32 [R, vocab]
    top: tuple[torch.Tensor, torch.Tensor] | None  # (values, ids) [R, max count]
    # Those of the token ids each row named (SamplingParams.logprob_token_ids),
    # or None when no row named any.
    named: NamedLogprobs | None = None

    @classmethod
    def of(cls, logits: torch.Tensor, seqs: Seq[Sequence]) -> RowLogprobs | None:
        """For logits [N, vocab] of seqs (row i to seqs[i]); None when no row asks."""
        rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs >= 0]
        if not rows:
            return None
        counts = [seqs[row].params.logprobs for row in rows]
        chosen = logits if len(rows) == len(seqs) else logits.index_select(0, _index(rows, logits))
        logprobs = torch.log_softmax(chosen.float(), dim=-1)
        widest = max(counts)
        top = logprobs.topk(widest, dim=-1) if widest > 0 else None
        named = NamedLogprobs.of(logprobs, [seqs[row].params.logprob_token_ids for row in rows])
        return cls(rows, counts, logprobs, (top.values, top.indices) if top else None, named)

    def to_host(self, tokens: torch.Tensor) -> HostLogprobs:
        """Gather the sampled tokens' (tokens: int64 [N] of all sampled rows)
        and start copying everything to the host; the caller marks when the
        copies are done."""
        device = self.logprobs.device
        picked = tokens.index_select(0, _index(self.rows, tokens)) if len(self.rows) < len(tokens) \
            else tokens
        sampled = self.logprobs.gather(1, picked.view(-1, 1)).view(-1)
        pin = device.type == "cuda"

        def host(tensor: torch.Tensor) -> torch.Tensor:
            if not pin:
                return tensor
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return copy.copy_(tensor, non_blocking=True)

        top = (host(self.top[0]), host(self.top[1])) if self.top is not None else None
        named = (NamedLogprobs(self.named.lengths, host(self.named.values))
                 if self.named is not None else None)
        return HostLogprobs(self.rows, self.counts, host(sampled), top, named)


@dataclass
class NamedLogprobs:
    """The log probabilities of the token ids rows named, gathered on the
    logits' device from the rows' log_softmax: one small gather, no second
    pass over the vocabulary."""

    lengths: list[int]  # ids each row named
    values: torch.Tensor  # float32 [R, most named], padded rows past their length

    @classmethod
    def of(cls, logprobs: torch.Tensor, named: list[list[int]]) -> NamedLogprobs | None:
        """logprobs [R, vocab] of the asking rows, named[i] row i's ids."""
        widest = max(len(ids) for ids in named)
        if widest == 0:
            return None
        # Short rows are padded with token 0, whose values are never read.
        padded = [ids + [0] * (widest - len(ids)) for ids in named]
        index = torch.tensor(padded, dtype=torch.int64).to(logprobs.device, non_blocking=True)
        return cls([len(ids) for ids in named], logprobs.gather(1, index))


@dataclass
class HostLogprobs:
    rows: list[int]
    counts: list[int]
    sampled: torch.Tensor  # float32 [R]
    top: tuple[torch.Tensor, torch.Tensor] | None
    named: NamedLogprobs | None = None

    def per_row(self, num_rows: int) -> list[TokenLogprobs | None]:
        """One entry per sampled row of the part (None for rows that did not
        ask); read only once the copies are done."""
        result: list[TokenLogprobs | None] = [None] * num_rows
        sampled = self.sampled.tolist()
        values = self.top[0].tolist() if self.top is not None else None
        ids = self.top[1].tolist() if self.top is not None else None
        named = self.named.values.tolist() if self.named is not None else None
        for i, (row, count) in enumerate(zip(self.rows, self.counts, strict=True)):
            if values is None or ids is None or count == 0:
                entry = TokenLogprobs(sampled[i])
            else:
                entry = TokenLogprobs(sampled[i], ids[i][:count], values[i][:count])
            if named is not None and self.named is not None and self.named.lengths[i]:
                entry.named_logprobs = named[i][: self.named.lengths[i]]
            result[row] = entry
        return result


@dataclass
class PromptScores:
    """Log probabilities of some prompt tokens, each given the tokens before
    it: the raw distribution at the positions before them."""

    sampled: torch.Tensor  # float32 [n], of the prompt token at each next position
    top: tuple[torch.Tensor, torch.Tensor] | None  # (values, ids) [n, count]
    count: int

    @classmethod
    def of(cls, hidden: torch.Tensor, targets: list[int], count: int, block: int,
           compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PromptScores:
        """hidden [n, H] of the positions, targets the n tokens after them;
        logits are made `block` rows at a time, so a long prompt never holds
        a whole [n, vocab] matrix."""
        target = torch.tensor(targets, dtype=torch.int64).to(hidden.device, non_blocking=True)
        sampled, values, ids = [], [], []
        for start in range(0, hidden.shape[0], block):
            logprobs = torch.log_softmax(compute_logits(hidden[start : start + block]).float(),
                                         dim=-1)
            sampled.append(logprobs.gather(1, target[start : start + block].view(-1, 1)).view(-1))
            if count:
                top = logprobs.topk(count, dim=-1)
                values.append(top.values)
                ids.append(top.indices)
        top_pair = (torch.cat(values), torch.cat(ids)) if count else None
        return cls(torch.cat(sampled), top_pair, count)

    def entries(self) -> list[TokenLogprobs]:
        """On the host (waits for the device)."""
        sampled = self.sampled.tolist()
        if self.top is None:
            return [TokenLogprobs(value) for value in sampled]
        values, ids = self.top[0].tolist(), self.top[1].tolist()
        return [TokenLogprobs(value, row_ids, row_values)
                for value, row_ids, row_values in zip(sampled, ids, values, strict=True)]


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).to(like.device, non_blocking=True)
