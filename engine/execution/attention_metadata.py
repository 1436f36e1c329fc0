"""What one forward pass needs to know about the sequences in its batch.

A step packs several sequences' new tokens into one flat batch of T tokens:
decode rows contribute one token each, prefill chunks several. Sequence b owns
rows query_start_loc[b]:query_start_loc[b+1] and, after this step, has
seq_lens[b] tokens in its KV cache; its new tokens sit at positions
seq_lens[b] - q_len_b ... seq_lens[b] - 1 and attend causally to everything
before them. K/V of the new tokens are written to the flat cache slots in
slot_mapping (page * page_size + offset) before attention reads the pages
listed in block_tables. Hybrid models add each sequence's state slot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B + 1], on the model's device
    seq_lens: torch.Tensor  # int32 [B], on the model's device
    block_tables: torch.Tensor  # int32 [B, max_pages], page ids; unused tail entries are 0
    slot_mapping: torch.Tensor  # int64 [T], on the model's device
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU reference ops can loop without device syncs.
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # Hybrid models' linear-attention layers (Qwen3-Next, Qwen3.5): sequence b's
    # conv and recurrent state live in slot state_slots[b] of each layer's
    # pools; state_fresh[b] says it starts from zero state (its first chunk).
    state_slots: torch.Tensor | None = None  # int64 [B]
    state_fresh: torch.Tensor | None = None  # bool [B]
    # Where a verify step lays every token out as an attention row of its
    # own (step_inputs.py), the linear-attention layers still see each
    # sequence's tokens together: their bounds [B' + 1], one per state slot.
    # None: the same as query_start_loc.
    state_query_start_loc: torch.Tensor | None = None
    state_query_start_loc_host: tuple[int, ...] | None = None

    def for_recurrent_state(self) -> AttentionMetadata:
        """The metadata the linear-attention layers read: query_start_loc
        over the sequences that own state_slots."""
        if self.state_query_start_loc is None:
            return self
        return dataclasses.replace(
            self, query_start_loc=self.state_query_start_loc,
            query_start_loc_host=self.state_query_start_loc_host or (),
            state_query_start_loc=None, state_query_start_loc_host=None)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]
