"""Qwen3-VL's vision tower: patch embedding with a bias plus a learned
position table resampled to each image's grid, LayerNorm blocks with a GELU
MLP attending over each whole frame, the final merger, and the deepstack
mergers: after each layer in deepstack_visual_indexes its own merger turns
the hidden states into features the text model adds to its early layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.vision.config import VisionTowerConfig
from engine.models.vision.grid import Grid, Segments, frame_lengths, patch_positions
from engine.models.vision.layers import Device, PatchMerger, PlainMLP, VisionBlock, VisionRotary
from engine.models.weight_alloc import empty_weight

_MERGER_NAMES = ("norm", "linear_fc1", "linear_fc2")


def _axis_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear resampling of a side-long table axis to size positions, corners
    aligned (position 0 on entry 0, the last on entry side - 1): each
    position's two entries and the second one's weight."""
    where = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    low = where.floor()
    return low.long(), (low.long() + 1).clamp(max=side - 1), where - low


def position_embedding(table: torch.Tensor, grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """The learned [side * side, hidden] position table bilinearly resampled
    to every image's grid, in the patches' merge-block order, float32
    [num_patches, hidden] (transformers' fast_pos_embed_interpolate)."""
    side = int(table.shape[0] ** 0.5)
    grid_table = table.float().view(side, side, -1)
    out = []
    for t, h, w in grids:
        row_lo, row_hi, row_frac = (x.to(table.device) for x in _axis_taps(h, side))
        col_lo, col_hi, col_frac = (x.to(table.device) for x in _axis_taps(w, side))
        top = (grid_table[row_lo] * (1 - row_frac)[:, None, None]
               + grid_table[row_hi] * row_frac[:, None, None])  # [h, side, hidden]
        image = top[:, col_lo] * (1 - col_frac)[None, :, None] + top[:, col_hi] * col_frac[None, :, None]
        blocks = image.view(h // merge, merge, w // merge, merge, -1).permute(0, 2, 1, 3, 4)
        out.append(blocks.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(out)


class Qwen3VisionTower(nn.Module):
    def __init__(self, config: VisionTowerConfig, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        side = int(config.num_position_embeddings ** 0.5)
        if side < 2 or side * side != config.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {config.num_position_embeddings} "
                             "is not the square of a side of 2 or more")
        self.config = config
        self.patch_weight = empty_weight((config.hidden_size, config.patch_dim), device, dtype)
        self.patch_bias = empty_weight((config.hidden_size,), device, dtype)
        self.pos_embed = empty_weight((config.num_position_embeddings, config.hidden_size),
                                      device, dtype)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(
            VisionBlock(config, "layer", PlainMLP(config, device, dtype), device, dtype)
            for _ in range(config.depth))
        self.merger = PatchMerger(config, "layer", False, _MERGER_NAMES, device, dtype)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(config, "layer", True, _MERGER_NAMES, device, dtype)
            for _ in config.deepstack_visual_indexes)

    @property
    def device(self) -> torch.device:
        return self.patch_weight.device

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """patches [num_patches, patch_dim] (patches.pixel_patches, images in
        turn), grids the images' (t, h, w) -> (embeddings [num_tokens,
        out_hidden_size], one [num_tokens, out_hidden_size] per deepstack layer,
        in deepstack_visual_indexes' order)."""
        config = self.config
        device = self.device
        frames = Segments(frame_lengths(grids), device)
        x = F.linear(patches.to(self.patch_weight.dtype), self.patch_weight, self.patch_bias)
        x = x + position_embedding(self.pos_embed, grids, config.merge_size).to(x.dtype)
        cos, sin = self.rotary.cos_sin(patch_positions(grids, config.merge_size).to(device))
        deepstack: list[torch.Tensor] = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if index in config.deepstack_visual_indexes:
                merger = self.deepstack_mergers[config.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every weight slot by its checkpoint name under prefix ("model.visual"
        in Qwen3-VL checkpoints)."""
        c = self.config
        conv_shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size,
                      c.patch_size)
        dests = {
            f"{prefix}.patch_embed.proj.weight": self.patch_weight.view(conv_shape),
            f"{prefix}.patch_embed.proj.bias": self.patch_bias,
            f"{prefix}.pos_embed.weight": self.pos_embed,
        }
        for index, block in enumerate(self.blocks):
            dests.update(block.weight_destinations(f"{prefix}.blocks.{index}"))
        dests.update(self.merger.weight_destinations(f"{prefix}.merger"))
        for index, merger in enumerate(self.deepstack_mergers):
            dests.update(merger.weight_destinations(f"{prefix}.deepstack_merger_list.{index}"))
        return dests
