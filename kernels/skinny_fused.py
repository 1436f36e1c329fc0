"""The skinny GEMM (kernels/skinny_gemm.py, 1..8 rows) with a dense decoder
layer's neighbouring work folded in (kernels/csrc/skinny_fused.cu), so that
a batch-1 layer launches six kernels instead of nine:

    norm_skinny_linear(x, norm_weight, eps, weight, bias)
        = skinny_linear(rms_norm(x, norm_weight, eps), weight, bias)   (QKV)
    norm_skinny_swiglu(x, norm_weight, eps, gate_up)
        = silu_and_mul(skinny_linear(rms_norm(x, ...), gate_up))       (gate/up)
    skinny_linear_add_(x, weight, bias, residual)
        : residual += skinny_linear(x, weight, bias), in place         (o, down)

Each gives the bits of the unfused chain of our kernels wherever the chain's
skinny_linear splits K the same way (the same warps and steps: always for
the first and the last; for the SwiGLU kernel whenever the [2I, K] GEMM
would use eight warps or fewer, as at every Qwen3 shape). The norm
prologue repeats kernels/csrc/norm.cu's sums in its order for each row, in
every CTA (a row is at most 16,384 bf16 and comes from L2), and stages the
normalized rows in shared memory for the mma loop.

CUDA-graph safe as skinny_linear: nothing allocated with `out` given,
nothing synced, the grid a function of the shapes and the SM count.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import (
    check_cuda_tensor,
    device_index_of,
    launch,
    load_kernel,
    ptr,
    set_max_dynamic_shared,
    sm_count,
    tensors_overlap,
)
from kernels.skinny_gemm import (
    SKINNY_MAX_ROWS,
    _checked_out,
    _layout,
    k_split,
    skinny_linear_supported,
    skinny_weight_supported,
)

_SOURCE = "skinny_fused.cu"
_VECTOR_BYTES = 16
# norm.cu's widest row; the normalized rows of a CTA live in shared memory.
NORM_MAX_K = 16384
# The most dynamic shared memory the norm prologue's rows may take: Hopper's
# 227 KiB an SM less the kernels' static 8 KiB of partial sums, rounded down.
NORM_MAX_SHARED_BYTES = 216 * 1024
# The SwiGLU kernel's CTA: 8 gate rows and their 8 up rows, at most 8 warps.
_SWIGLU_MAX_WARPS = 8


def rows_fusable(hidden: torch.Tensor) -> bool:
    """Whether hidden (a decoder layer's input rows) can enter the fused
    kernels: bf16 [M, H], 1 <= M <= 8, contiguous, 16-byte aligned, on a GPU,
    its normalized rows within the norm prologue's shared memory."""
    return (hidden.is_cuda and hidden.dtype == torch.bfloat16 and hidden.dim() == 2
            and 1 <= hidden.shape[0] <= SKINNY_MAX_ROWS and hidden.is_contiguous()
            and hidden.data_ptr() % 16 == 0 and norm_fits(*hidden.shape))


def norm_fits(rows: int, k: int) -> bool:
    """Whether the norm prologue takes rows x K: K up to NORM_MAX_K (norm.cu's
    widest row) and the normalized rows within NORM_MAX_SHARED_BYTES."""
    return k <= NORM_MAX_K and _normalized_bytes(rows, k) <= NORM_MAX_SHARED_BYTES


def weight_fusable(weight: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether a layer's projection can be a fused kernel's matrix for
    hidden's rows, whatever x it multiplies: a skinny GEMM's matrix on
    hidden's device with K up to NORM_MAX_K."""
    return skinny_weight_supported(weight, hidden.device) and weight.shape[1] <= NORM_MAX_K


def fusable(x: torch.Tensor, weight: torch.Tensor, *, norm: bool = False) -> bool:
    """Whether the fused kernels take (x, weight): skinny_linear's rules, and
    with a norm prologue norm_fits (a cheap host-side check)."""
    if not skinny_linear_supported(x, weight, SKINNY_MAX_ROWS):
        return False
    return not norm or norm_fits(*x.shape)


def _normalized_bytes(rows: int, k: int) -> int:
    """Shared memory of the norm prologue: rows of K / 8 + 1 vectors (the
    extra one staggers the rows across the banks)."""
    return rows * (k // 8 + 1) * _VECTOR_BYTES


def _check_norm_weight(norm_weight: torch.Tensor, k: int, device: torch.device) -> None:
    check_cuda_tensor("norm_weight", norm_weight, dtype=torch.bfloat16, ndim=1, device=device)
    if norm_weight.shape[0] != k:
        raise ValueError(f"norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    if not norm_weight.is_contiguous() or norm_weight.data_ptr() % 16:
        raise ValueError("norm_weight must be contiguous and 16-byte aligned")


def _check_norm_rows(x: torch.Tensor) -> None:
    rows, k = x.shape
    if not norm_fits(rows, k):
        raise ValueError(f"the norm prologue takes K up to {NORM_MAX_K} and at most "
                         f"{NORM_MAX_SHARED_BYTES} bytes of normalized rows; {rows} rows of "
                         f"K = {k} need {_normalized_bytes(rows, k)}")


def norm_skinny_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """skinny_linear(rms_norm(x, norm_weight, eps), weight, bias) in one kernel.
    x: bf16 [M, K], M <= 8; norm_weight: bf16 [K]; weight: bf16 [N, K]."""
    out = _checked_out(x, weight, bias, out, SKINNY_MAX_ROWS)
    _check_norm_rows(x)
    rows, k = x.shape
    _check_norm_weight(norm_weight, k, x.device)
    n = weight.shape[0]
    index = device_index_of(x)
    row_groups, ctas, warps, steps = _layout(n, k, sm_count(index))
    kernel = load_kernel(_SOURCE, f"skinny_norm_gemm_m{rows}_rg{row_groups}", index)
    shared = _normalized_bytes(rows, k)
    set_max_dynamic_shared(kernel, shared)
    args = (ptr(out), ptr(x), ptr(weight), ptr(bias) if bias is not None else np.uint64(0),
            np.int32(n), np.int32(k), np.int32(steps), ptr(norm_weight), np.float32(eps),
            np.float32(1.0 / k))
    launch(kernel, (ctas,), (32 * warps,), args, x.device, shared)
    return out


def swiglu_layout(intermediate: int, k: int) -> tuple[int, int, int]:
    """(CTAs, warps per CTA, steps of 128 K) of the SwiGLU kernel."""
    warps, steps = k_split(k, _SWIGLU_MAX_WARPS)
    return -(-intermediate // 8), warps, steps


def norm_skinny_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul(skinny_linear(rms_norm(x, norm_weight, eps), gate_up)) in
    one kernel. gate_up: bf16 [2I, K], the gate rows then the up rows.
    Returns (or fills) out, bf16 [M, I]."""
    check_cuda_tensor("x", x, dtype=torch.bfloat16, ndim=2)
    check_cuda_tensor("gate_up", gate_up, dtype=torch.bfloat16, ndim=2, device=x.device)
    if gate_up.shape[0] % 2:
        raise ValueError(f"gate_up must have an even number of rows, got {gate_up.shape[0]}")
    intermediate = gate_up.shape[0] // 2
    if not gate_up.is_contiguous():
        raise ValueError("gate_up must be contiguous")
    if out is None:
        out = torch.empty((x.shape[0], intermediate), dtype=torch.bfloat16, device=x.device)
    # A skinny GEMM's checks against the gate half (same K, alignment, out).
    _checked_out(x, gate_up[:intermediate], None, out, SKINNY_MAX_ROWS)
    if tensors_overlap(out, gate_up):
        raise ValueError("out must not overlap gate_up")
    _check_norm_rows(x)
    rows, k = x.shape
    _check_norm_weight(norm_weight, k, x.device)
    ctas, warps, steps = swiglu_layout(intermediate, k)
    index = device_index_of(x)
    kernel = load_kernel(_SOURCE, f"skinny_norm_swiglu_m{rows}", index)
    shared = _normalized_bytes(rows, k)
    set_max_dynamic_shared(kernel, shared)
    args = (ptr(out), ptr(x), ptr(gate_up), np.int32(intermediate), np.int32(k),
            np.int32(steps), ptr(norm_weight), np.float32(eps), np.float32(1.0 / k))
    launch(kernel, (ctas,), (32 * warps,), args, x.device, shared)
    return out


def skinny_linear_add_(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       residual: torch.Tensor) -> torch.Tensor:
    """residual += skinny_linear(x, weight, bias), rounded as torch adds two
    bf16 tensors (the projection rounded first); returns residual.
    residual: bf16 [M, N], contiguous, not overlapping the inputs.
    Each element is read and written by one thread: in place is safe."""
    _checked_out(x, weight, bias, residual, SKINNY_MAX_ROWS)
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous")
    rows, k = x.shape
    n = weight.shape[0]
    index = device_index_of(x)
    row_groups, ctas, warps, steps = _layout(n, k, sm_count(index))
    kernel = load_kernel(_SOURCE, f"skinny_gemm_add_m{rows}_rg{row_groups}", index)
    args = (ptr(residual), ptr(x), ptr(weight), ptr(bias) if bias is not None else np.uint64(0),
            np.int32(n), np.int32(k), np.int32(steps))
    launch(kernel, (ctas,), (32 * warps,), args, x.device)
    return residual
