"""Sampled tokens that the host has not seen yet, kept on the device.

The engine schedules and launches step N + 1 before step N's tokens reach the
host (engine/scheduling/core.py). A sequence decoding in both steps feeds step
N's token to step N + 1, so that token must come from the device: step N's
sampler writes its tokens into slots of this buffer, the scheduler puts a
placeholder -(slot + 1) in the sequence's token ids, and the forward pass of
any step replaces a negative input id by the slot's token before the
embedding (inside the CUDA graph for decode steps).

Two halves of `rows` slots alternate between launches. A placeholder is read
only by the step launched right after the one that wrote its slot (the host
knows the real token before it schedules the step after that, and never
admits a sequence whose newest token it does not know), and the device runs
steps in launch order, so a half is written again only after its last reader.
"""

from __future__ import annotations

import torch


class FutureTokens:
    def __init__(self, rows: int, device: torch.device) -> None:
        """rows: the most tokens one step samples (one per lane)."""
        self.rows = rows
        self.buffer = torch.zeros(2 * rows, dtype=torch.int64, device=device)
        self._turn = 0

    def next_slots(self) -> int:
        """The first slot for the next launch's tokens (slots first.. first + rows)."""
        self._turn ^= 1
        return self._turn * self.rows

    def write(self, first_slot: int, tokens: torch.Tensor, rows: list[int] | None = None) -> None:
        """Token i goes to slot first_slot + i, or, with rows (some of a
        step's sampling rows), to slot first_slot + rows[i]."""
        count = tokens.numel()
        if count > self.rows or (rows is not None and rows and max(rows) >= self.rows):
            raise ValueError(f"a step sampled {count} tokens (rows {rows}); the future buffer "
                             f"holds {self.rows}")
        if rows is None:
            self.buffer[first_slot : first_slot + count].copy_(tokens, non_blocking=True)
            return
        slots = torch.tensor([first_slot + row for row in rows], dtype=torch.int64)
        self.buffer.index_copy_(0, slots.to(self.buffer.device, non_blocking=True), tokens)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids with each placeholder -(slot + 1) replaced by its slot's
        token; no host synchronisation (capturable in a CUDA graph)."""
        slots = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids < 0, self.buffer.index_select(0, slots), input_ids)
