"""Qwen2.5-VL's vision tower: patch embedding, RMSNorm blocks with a SwiGLU
MLP whose attention is windowed except in fullatt_block_indexes, and the
patch merger.

Windowed layers attend within square tiles of window_size pixels; to make
every window a consecutive run of patches the tower reorders the patches
window by window before the first block (merge blocks stay whole, so the
order is a permutation of output tokens) and puts the merged tokens back in
image order at the end. Full-attention layers attend over each frame, which
stays one consecutive run in the window order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.models.vision.config import VisionTowerConfig
from engine.models.vision.grid import Grid, Segments, frame_lengths, patch_positions, window_order
from engine.models.vision.layers import Device, GatedMLP, PatchMerger, VisionBlock, VisionRotary
from engine.models.weight_alloc import empty_weight


class Qwen25VisionTower(nn.Module):
    def __init__(self, config: VisionTowerConfig, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        window_tokens = config.window_size // config.merge_size // config.patch_size
        if window_tokens < 1:
            raise ValueError(f"vision window_size {config.window_size} is smaller than one merged "
                             f"patch ({config.merge_size * config.patch_size} pixels)")
        self.config = config
        self.window_tokens = window_tokens
        # The Conv3d whose kernel equals its stride, as a matrix over flattened patches.
        self.patch_weight = empty_weight((config.hidden_size, config.patch_dim), device, dtype)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(
            VisionBlock(config, "rms", GatedMLP(config, device, dtype), device, dtype)
            for _ in range(config.depth))
        self.merger = PatchMerger(config, "rms", False, ("ln_q", "mlp.0", "mlp.2"), device, dtype)

    @property
    def device(self) -> torch.device:
        return self.patch_weight.device

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """patches [num_patches, patch_dim] (patches.pixel_patches, images in
        turn), grids the images' (t, h, w) -> ([num_tokens, out_hidden_size],
        []: Qwen2.5-VL has no deepstack features)."""
        config = self.config
        unit = config.merge_unit
        device = self.device
        token_order, window_lengths = window_order(grids, config.merge_size, self.window_tokens)
        patch_order = (token_order.view(-1, 1) * unit + torch.arange(unit)).view(-1).to(device)
        windows = Segments(window_lengths, device)
        frames = Segments(frame_lengths(grids), device)

        x = torch.nn.functional.linear(patches.to(self.patch_weight.dtype), self.patch_weight)
        x = x[patch_order]
        cos, sin = self.rotary.cos_sin(patch_positions(grids, config.merge_size).to(device))
        cos, sin = cos[patch_order], sin[patch_order]
        for index, block in enumerate(self.blocks):
            full = index in config.fullatt_block_indexes
            x = block(x, cos, sin, frames if full else windows)
        merged = self.merger(x)
        image_order = torch.argsort(token_order).to(device)
        return merged[image_order], []

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every weight slot by its checkpoint name under prefix ("visual" in
        Qwen2.5-VL checkpoints)."""
        c = self.config
        conv_shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size,
                      c.patch_size)
        dests = {f"{prefix}.patch_embed.proj.weight": self.patch_weight.view(conv_shape)}
        for index, block in enumerate(self.blocks):
            dests.update(block.weight_destinations(f"{prefix}.blocks.{index}"))
        dests.update(self.merger.weight_destinations(f"{prefix}.merger"))
        return dests
