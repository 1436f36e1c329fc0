"""Launching the next decode step before the host has this one's tokens.

A decode step's host work (bookkeeping, outputs, scheduling, inputs) would
otherwise leave the GPU idle between steps. So when every row of a decode
step can simply go on, the runner launches the following step right behind
it, its token ids taken on the device from this step's samples, and only then
waits for this step's tokens. The host's work on step N then overlaps the
GPU's work on step N + 1.

The scheduler stays the authority: the next execute() uses the launched step
only if the scheduler asks for exactly that step (the same sequences, in the
same order, each one token further); otherwise the launched work is dropped.
Dropping is always safe: the step only wrote each row's next KV slot, inside a
page the sequence already held and that is not yet full (so no prefix-cache
page), and whatever sequence next owns that slot writes it before reading it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.execution.step_inputs import StepInputs, block_tables_of, slots_of
from engine.scheduling.scheduler import SchedulerOutput

StepKey = tuple[tuple[str, int], ...]


@dataclass
class LaunchedStep:
    key: StepKey
    inputs: StepInputs
    tokens: torch.Tensor  # int64 [B] on the device
    host: torch.Tensor  # page-locked copy of tokens, valid once done has passed
    done: torch.cuda.Event


def scheduled_key(out: SchedulerOutput) -> StepKey | None:
    """The identity of a pure decode step (every chunk one sampled token)."""
    if not all(chunk.num_tokens == 1 and chunk.samples for chunk in out.chunks):
        return None
    return tuple((chunk.seq.request_id, chunk.start) for chunk in out.chunks)


def inputs_key(inputs: StepInputs) -> StepKey:
    return tuple((seq.request_id, int(position))
                 for seq, position in zip(inputs.sample_seqs, inputs.positions, strict=True))


def next_decode_inputs(inputs: StepInputs, page_size: int, max_context: int) -> StepInputs | None:
    """The step after `inputs` if every row just continues, or None when one
    cannot be launched ahead: a row needing a page it does not hold yet, one
    about to reach max_tokens or the context, or one whose logits depend on
    host work (a grammar mask, penalties over its tokens)."""
    if not inputs.is_decode or len(inputs.sample_rows) != inputs.num_tokens:
        return None
    positions = inputs.positions + 1
    for seq, position in zip(inputs.sample_seqs, positions.tolist(), strict=True):
        params = seq.params
        if params.grammar is not None or params.has_penalties:
            return None
        # This step's token makes num_output + 1; the next step's, + 2.
        # The next step's token would sit at position + 1, inside the context.
        if seq.num_output_tokens + 2 > params.max_tokens or position + 2 > max_context:
            return None
        if position // page_size >= len(seq.block_table):
            return None
    tables = block_tables_of(inputs.sample_seqs)
    slots = slots_of(tables, np.arange(len(positions)), positions, page_size)
    return StepInputs(
        input_ids=np.zeros_like(inputs.input_ids),  # the device has them
        positions=positions,
        slot_mapping=slots,
        query_start_loc=inputs.query_start_loc,
        seq_lens=inputs.seq_lens + 1,
        block_tables=tables,
        sample_rows=inputs.sample_rows,
        sample_seqs=inputs.sample_seqs,
    )
