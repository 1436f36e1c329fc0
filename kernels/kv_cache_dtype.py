"""The element types a paged KV cache may have for our kernels: bf16, or
float8 e4m3 (an fp8 cache, --kv-dtype fp8) read and written with one scale
per tensor. An fp8 cache's kernels carry the suffix "_fp8" and take two more
float arguments: the writers k_scale and v_scale (they store e4m3(x / scale)),
the attention readers scale * 2^8 (kernels/csrc/decode_attention.cu's
widen_e4m3x2 explains the factor)."""

from __future__ import annotations

import math

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor

FP8 = torch.float8_e4m3fn
# The readers widen e4m3 through fp16 bits that hold value * 2^-8.
_E4M3_BIAS_SHIFT = 2.0**8


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor,
                    device: torch.device) -> bool:
    """Raise a ValueError unless both caches are contiguous 4-D CUDA tensors
    on device of one dtype, bf16 or float8_e4m3fn; True for fp8."""
    dtype = k_cache.dtype if k_cache.dtype in (torch.bfloat16, FP8) else torch.bfloat16
    check_cuda_tensor("k_cache", k_cache, dtype=dtype, ndim=4, device=device)
    check_cuda_tensor("v_cache", v_cache, dtype=dtype, ndim=4, device=device)
    return dtype == FP8


def _check_scale(name: str, scale: float) -> float:
    # A tensor scale would need a device read (a sync): only host numbers.
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise ValueError(f"{name} must be a Python number, got {type(scale).__name__}")
    scale = float(scale)
    # The readers multiply by scale * 2^8: a normal float32 across this range.
    if not (math.isfinite(scale) and 2.0**-64 < scale < 2.0**7):
        raise ValueError(f"{name} must be a positive, finite number below 128, got {scale}")
    return scale


def writer_scales(fp8: bool, k_scale: float, v_scale: float) -> tuple[np.float32, ...]:
    """The extra kernel arguments of a cache writer: none for bf16."""
    k_scale, v_scale = _check_scale("k_scale", k_scale), _check_scale("v_scale", v_scale)
    return (np.float32(k_scale), np.float32(v_scale)) if fp8 else ()


def reader_scales(fp8: bool, k_scale: float, v_scale: float) -> tuple[np.float32, ...]:
    """The extra kernel arguments of an attention kernel: none for bf16."""
    k_scale, v_scale = _check_scale("k_scale", k_scale), _check_scale("v_scale", v_scale)
    if not fp8:
        return ()
    return (np.float32(k_scale * _E4M3_BIAS_SHIFT), np.float32(v_scale * _E4M3_BIAS_SHIFT))
