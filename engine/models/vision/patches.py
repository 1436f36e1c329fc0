"""An image's pixels as the tower's input patches.

The router (router/media/loader.py) has already decoded, oriented and resized
the image to height = grid_h * patch_size, width = grid_w * patch_size. Here
its RGB bytes are rescaled by 1/255, normalised with the processor's
image_mean / image_std, repeated temporal_patch_size times (a still image is
a clip of one frame) and cut into flat patches in merge-block order, exactly
as transformers' Qwen2VLImageProcessorPil makes pixel_values: the same float
operations in the same order, so the values are bit-equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class PatchSettings(Protocol):
    """What this needs of the router's VisionSpec (router/media/types.py; the
    engine may not import the router)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: Sequence[float]
    image_std: Sequence[float]


def pixel_patches(rgb: bytes, grid_t: int, grid_h: int, grid_w: int, spec: PatchSettings,
                  dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """rgb: height * width * 3 uint8 bytes, row-major -> [grid_h * grid_w,
    3 * temporal_patch_size * patch_size**2] in dtype on device, each row one
    patch's values ordered (channel, time, row, column)."""
    if grid_t != 1:
        raise ValueError(f"a still image has grid_t 1, not {grid_t}")
    patch, merge, frames = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if grid_h % merge or grid_w % merge:
        raise ValueError(f"grid {grid_h} x {grid_w} is not a multiple of merge_size {merge}")
    height, width = grid_h * patch, grid_w * patch
    if len(rgb) != height * width * 3:
        raise ValueError(f"{len(rgb)} bytes of RGB are not a {width} x {height} image")
    # One host copy (bytes are read-only) and a uint8 upload; the arithmetic
    # runs where the tower does.
    pixels = torch.frombuffer(bytearray(rgb), dtype=torch.uint8).to(device)
    # As numpy's rescale: float64 times 1/255, rounded to float32 once ...
    image = (pixels.double() * (1 / 255)).float().view(height, width, 3)
    # ... then (x - mean) / std in float32.
    mean = torch.tensor(spec.image_mean, dtype=torch.float32, device=image.device)
    std = torch.tensor(spec.image_std, dtype=torch.float32, device=image.device)
    image = ((image - mean) / std).permute(2, 0, 1)  # [3, height, width]
    blocks = image.reshape(3, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    # -> (block row, block column, row in block, column in block, channel, y, x)
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)
    clip = blocks.unsqueeze(5).expand(*blocks.shape[:5], frames, patch, patch)
    return clip.reshape(grid_h * grid_w, 3 * frames * patch * patch).to(dtype)
