"""The Gated DeltaNet output norm on the GPU: RMSNorm per head times silu(gate).

Reference: kernels.hybrid_reference.gated_rms_norm. Same rounding steps (bf16
normalized value, bf16 weight product, float32 silu product rounded once);
only the variance's summation order differs, so an element can rarely differ
from torch on the GPU by a bf16 ulp or two. One launch where torch takes
about ten (casts, pow, mean, rsqrt, products, silu).

The gate is read through its strides (the z slice of GatedDeltaNet's input
projection, a view), so it is never copied. CUDA-graph safe: with `out`
given nothing is allocated and nothing syncs; the grid depends only on shapes.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor, launch, load_kernel, ptr

_SOURCE = "gated_norm.cu"
_HEAD_DIMS = (64, 128, 256)
_THREADS = 128
_VECTOR = 8  # bf16 per 16-byte access


def _gate_strides_ok(gate: torch.Tensor) -> bool:
    # 16-byte vector loads: every row of the gate starts on a 16-byte boundary.
    return (gate.dim() == 3 and gate.stride(2) == 1 and gate.stride(0) % _VECTOR == 0
            and gate.stride(1) % _VECTOR == 0 and gate.data_ptr() % 16 == 0)


def gated_norm_supported(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether the kernel takes these operands (else the caller uses the reference)."""
    return (x.is_cuda and gate.is_cuda and x.dtype == gate.dtype == torch.bfloat16
            and x.dim() == 3 and x.shape[-1] in _HEAD_DIMS and x.is_contiguous()
            and x.data_ptr() % 16 == 0 and gate.shape == x.shape and _gate_strides_ok(gate))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x: bf16 [T, H, D] contiguous, D 64, 128 or 256; gate: bf16 [T, H, D],
    any token / head strides that are multiples of 8 with the last dim
    contiguous; weight: bf16 [D].

    Returns (or fills) out, bf16 [T, H, D]:
    bf16(bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))) * silu(gate)), the
    mean over D and the silu product in float32. out must not overlap x or gate.
    """
    check_cuda_tensor("x", x, dtype=torch.bfloat16, ndim=3)
    tokens, heads, head_dim = x.shape
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"x's head size must be one of {_HEAD_DIMS}, got {head_dim}")
    if x.data_ptr() % 16:
        raise ValueError("x must start at a 16-byte aligned address")
    if not gate.is_cuda or gate.device != x.device or gate.dtype != torch.bfloat16:
        raise ValueError(f"gate must be a bf16 tensor on {x.device}")
    if gate.shape != x.shape:
        raise ValueError(f"gate must be {tuple(x.shape)}, got {tuple(gate.shape)}")
    if not _gate_strides_ok(gate):
        raise ValueError(f"gate's strides {gate.stride()} must be multiples of 8 with the last "
                         "dim contiguous, from a 16-byte aligned address")
    check_cuda_tensor("weight", weight, dtype=torch.bfloat16, ndim=1, device=x.device)
    if weight.shape[0] != head_dim or weight.data_ptr() % 16:
        raise ValueError(f"weight must be [{head_dim}], 16-byte aligned, got {tuple(weight.shape)}")
    rows = tokens * heads
    if rows * (head_dim // _VECTOR) >= 2**31:
        raise ValueError(f"too many rows ({rows}) for one launch")
    if out is None:
        out = torch.empty_like(x)
    else:
        check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=3, device=x.device)
        if out.shape != x.shape or out.data_ptr() % 16:
            raise ValueError(f"out must be {tuple(x.shape)}, 16-byte aligned")
        if rows and (_overlaps(out, x) or _overlaps(out, gate)):
            raise ValueError("out must not overlap x or gate")
    if rows == 0:
        return out
    kernel = load_kernel(_SOURCE, f"gated_rms_norm_d{head_dim}", x.device.index or 0)
    grid = -(-rows * (head_dim // _VECTOR) // _THREADS)
    args = (ptr(out), ptr(x), ptr(gate), ptr(weight), np.int32(rows), np.int32(heads),
            np.int64(gate.stride(0)), np.int64(gate.stride(1)), np.float32(eps))
    launch(kernel, (grid,), (_THREADS,), args, x.device)
    return out


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of a and b (first to last element) intersect."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + _span_bytes(a)
    b_end = b_start + _span_bytes(b)
    return a_start < b_end and b_start < a_end


def _span_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()
