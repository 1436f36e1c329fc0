"""What a verify step's draft positions need beyond their logits
(engine/sampling/verify.py): the draft tokens each position's context holds,
for the penalties, and the log probabilities of the target's tokens there,
for the rows that ask.

An accepted token's log probabilities come from its own position's
distribution, exactly as plain decoding would report them there: the raw
log_softmax taken before the sampler masks, biases or penalises the logits
(RowLogprobs), or in "processed" mode the distribution the target's token
was drawn from (engine/sampling/processed_logprobs.py). The model runner
makes a verify step's logits a block of rows at a time; each block's log
probabilities start their way to the host with its tokens, and DraftLogprobs
puts the blocks back together per row.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.sampling.logprobs import HostLogprobs, RowLogprobs
from engine.sampling.processed_logprobs import use_processed
from engine.sampling.sampler import Sampler
from engine.scheduling.sequence import Sequence
from protocol import TokenLogprobs


def draft_contexts(seqs: Seq[Sequence], drafted: Seq[int]) -> list[list[int]]:
    """Per draft row (of seqs[i], whose input is the draft token drafted[i]),
    the draft tokens its context holds past the sequence's own: its chunk's
    drafts up to its own. A chunk's draft rows are consecutive, and no two
    chunks of a step share a Sequence."""
    contexts: list[list[int]] = []
    for row, (seq, token) in enumerate(zip(seqs, drafted, strict=True)):
        before = contexts[-1] if row and seqs[row - 1] is seq else []
        contexts.append([*before, token])
    return contexts


class DraftLogprobs:
    """The log probabilities of a verify step's target tokens, block by block."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, HostLogprobs | None]] = []

    @property
    def asked(self) -> bool:
        return any(part is not None for _, part in self._parts)

    def take(self, raw: RowLogprobs | None, logits: torch.Tensor, seqs: Seq[Sequence],
             targets: torch.Tensor, sampler: Sampler) -> None:
        """One block: raw, its rows' log probabilities taken before
        draw_targets (RowLogprobs.of; None when no row asks), logits as
        draw_targets left them, targets the tokens it drew."""
        if raw is not None:
            use_processed(raw, logits, seqs, sampler)
        self._parts.append((len(seqs), raw.to_host(targets) if raw is not None else None))

    def per_row(self, num_rows: int) -> list[TokenLogprobs | None]:
        """One entry per draft row (None for rows that did not ask); read
        once the copies are done."""
        rows: list[TokenLogprobs | None] = []
        for size, part in self._parts:
            rows.extend(part.per_row(size) if part is not None else [None] * size)
        assert len(rows) == num_rows, "one entry per draft row"
        return rows
