"""What a prefill step with images adds to a decoder's forward pass.

The model runner builds one MultimodalStepInputs for a step whose tokens
include image tokens (or whose positions are multimodal RoPE's); every other
step passes None and runs exactly as a text step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MultimodalStepInputs:
    # int64 [N]: the step's token rows (0 .. T-1 of its flat batch) whose
    # embeddings come from the vision tower instead of embed_tokens.
    rows: torch.Tensor
    # [N, H] in the model dtype: the tower's merged patch embeddings, row i
    # for token rows[i].
    embeddings: torch.Tensor
    # [T, D] or None: every token's cos|sin row (engine/models/mrope.py
    # mrope_rope_table over the whole step, text rows included); the step's
    # positions then only drive this table's rows as arange(T). None: the
    # model's own table at the step's positions.
    rope_table: torch.Tensor | None = None
    # Qwen3-VL's deepstack features: entry i ([N, H], model dtype) is added
    # to the hidden state at rows after decoder layer i.
    deepstack: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        rows = self.rows.shape[0]
        if self.embeddings.shape[0] != rows or any(f.shape[0] != rows for f in self.deepstack):
            raise ValueError(f"{rows} image rows with {self.embeddings.shape[0]} embeddings and "
                             f"deepstack rows {[f.shape[0] for f in self.deepstack]}")
