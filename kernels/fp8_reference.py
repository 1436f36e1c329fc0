"""Torch reference of FP8 weights: float8 e4m3 values with float32 scales,
one per 128 x 128 block of the matrix (issue 19).

This is the layout of Hugging Face FP8 checkpoints (quant_method "fp8", as
the FP8 releases of Qwen3 and DeepSeek use): `<name>.weight` float8_e4m3fn
[N, K] and `<name>.weight_scale_inv` float32 [ceil(N/128), ceil(K/128)],
the dequantized weight being value * its block's scale (the "inv" in the name
notwithstanding). A per-tensor checkpoint's single scale is the same table
with every block holding it (block_scales_of_tensor), so one layout serves
both. quantize_blocks makes it from a float matrix (--quantize fp8).

This is the CPU path of FP8 weights and what the CUDA kernels
(kernels/fp8_linear.py) are checked against.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
# Rows and columns of the matrix that one scale covers.
FP8_BLOCK = 128
# e4m3's largest finite magnitude.
E4M3_MAX = 448.0


def scale_shape(n: int, k: int) -> tuple[int, int]:
    """The block scale table's shape for a matrix [n, k]."""
    return (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))


def expand_scales(scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The per-element scale [n, k] of a block table (float32)."""
    full = scales.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return full[:n, :k]


def dequantize(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] = e4m3 value * its block's scale, each product rounded
    once to float32 (exact where the scale has at most 20 significant bits,
    a power of two for one)."""
    n, k = weight.shape
    if tuple(scales.shape) != scale_shape(n, k):
        raise ValueError(f"scales must be {scale_shape(n, k)} for a [{n}, {k}] weight, "
                         f"got {tuple(scales.shape)}")
    return weight.float() * expand_scales(scales, n, k).to(weight.device)


def block_scales_of_tensor(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A per-tensor scale (one element) as a block table of that scale."""
    if scale.numel() != 1:
        raise ValueError(f"a per-tensor scale has one element, got shape {tuple(scale.shape)}")
    return scale.float().reshape(1, 1).expand(scale_shape(n, k)).contiguous()


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [N, K] as (e4m3 [N, K], float32 scales): each block's
    scale is its largest magnitude / 448, so the block fills e4m3's range;
    an all-zero block gets scale 1. Runs on weight's device."""
    n, k = weight.shape
    rows, cols = scale_shape(n, k)
    padded = torch.zeros((rows * FP8_BLOCK, cols * FP8_BLOCK), dtype=torch.float32,
                         device=weight.device)
    padded[:n, :k] = weight
    blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = (blocks / scales[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    values = scaled.view(rows * FP8_BLOCK, cols * FP8_BLOCK)[:n, :k].to(FP8)
    return values.contiguous(), scales.contiguous()
