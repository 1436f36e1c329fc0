"""RMSNorm and the fused residual add + RMSNorm on the GPU.

References: kernels.reference.rms_norm and add_rms_norm. Same rounding steps
(bf16 sum, float32 variance, bf16 normalized value, bf16 * bf16 weight
product); only the order of the variance sum differs, so an element can
rarely differ from the reference by one bf16 ulp.

zero_centred=True is Qwen3-Next's and Qwen3.5's norm
(kernels.hybrid_reference.zero_centred_rms_norm / add_zero_centred_rms_norm):
bf16(x32 * rsqrt(mean(x32^2) + eps) * (1 + w32)), float32 until one rounding.

CUDA-graph safe: with `out` given nothing is allocated, nothing syncs, and the
launch grid depends only on the shapes.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor, launch, load_kernel, ptr, tensors_overlap

_SOURCE = "norm.cu"
_VECTOR = 8  # bf16 per 16-byte access
_MAX_HIDDEN = 16384
# Rows of at most 128 vectors (H <= 1024) get a warp each; wider rows a CTA
# each, of at most 256 threads holding 2, 4 or 8 vectors.
_WARP_ROW_MAX_VECTORS = 128
# Warp rows: one per CTA for small batches, so that the rows spread over all
# the SMs and their loads are all in flight at once (decode); 4 per CTA for
# large ones, since an SM holds at most 32 CTAs and 1-warp CTAs would cap it
# at half its warps.
_WARP_ROWS_PER_CTA_LARGE = 4
_LARGE_BATCH = 1024
_BLOCK_MAX_THREADS = 256


def _layout(hidden: int, tokens: int) -> tuple[str, tuple[int], tuple[int]]:
    """(kernel name suffix, grid, block) for rows of `hidden` elements."""
    vectors = hidden // _VECTOR
    if vectors <= _WARP_ROW_MAX_VECTORS:
        per_thread = -(-vectors // 32)
        rows_per_cta = _WARP_ROWS_PER_CTA_LARGE if tokens >= _LARGE_BATCH else 1
        grid = -(-tokens // rows_per_cta)
        return f"warp{per_thread}", (grid,), (32 * rows_per_cta,)
    per_thread = next(v for v in (2, 4, 8) if vectors <= v * _BLOCK_MAX_THREADS)
    threads = -(-vectors // per_thread)
    threads = -(-threads // 32) * 32
    return f"block{per_thread}", (tokens,), (threads,)


def rows_supported(x: torch.Tensor) -> bool:
    """Whether the kernels take x as rows (else the caller uses the reference)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous()
            and x.shape[-1] % _VECTOR == 0 and 0 < x.shape[-1] <= _MAX_HIDDEN
            and x.data_ptr() % 16 == 0)


def _check_rows(name: str, x: torch.Tensor) -> tuple[int, int]:
    check_cuda_tensor(name, x, dtype=torch.bfloat16, ndim=2)
    tokens, hidden = x.shape
    if hidden % _VECTOR or not 0 < hidden <= _MAX_HIDDEN:
        raise ValueError(
            f"{name}'s last dim must be a multiple of {_VECTOR} in [8, {_MAX_HIDDEN}], got {hidden}"
        )
    if tokens >= 2**31:
        raise ValueError(f"{name} has too many rows ({tokens})")
    _check_aligned(name, x)
    return tokens, hidden


def _check_aligned(name: str, tensor: torch.Tensor) -> None:
    # 16-byte vector accesses: a view starting mid-vector would fault.
    if tensor.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address")


def _check_weight(weight: torch.Tensor, hidden: int, device: torch.device) -> None:
    check_cuda_tensor("weight", weight, dtype=torch.bfloat16, ndim=1, device=device)
    if weight.shape[0] != hidden:
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    _check_aligned("weight", weight)


def _check_or_make_out(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(x)
    check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=2, device=x.device)
    if out.shape != x.shape:
        raise ValueError(f"out must be {tuple(x.shape)}, got {tuple(out.shape)}")
    _check_aligned("out", out)
    return out


def _kernel_name(add: bool, zero_centred: bool, suffix: str) -> str:
    return f"{'add_' if add else ''}{'zc_' if zero_centred else ''}rms_norm_{suffix}"


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    *, zero_centred: bool = False,
) -> torch.Tensor:
    """x: bf16 [T, H], H a multiple of 8 up to 16384; weight: bf16 [H].

    Returns (or fills) out, bf16 [T, H]: weight * bf16(x * rsqrt(mean(x^2) + eps)),
    or with zero_centred bf16(x * rsqrt(mean(x^2) + eps) * (1 + weight)) in float32.
    out may be x itself (each element is read before it is written).
    """
    tokens, hidden = _check_rows("x", x)
    _check_weight(weight, hidden, x.device)
    out = _check_or_make_out(out, x)
    if tokens == 0:
        return out
    suffix, grid, block = _layout(hidden, tokens)
    kernel = load_kernel(_SOURCE, _kernel_name(False, zero_centred, suffix), x.device.index or 0)
    args = (ptr(out), np.uint64(0), ptr(x), ptr(weight), np.int32(tokens), np.int32(hidden),
            np.float32(1.0 / hidden), np.float32(eps))
    launch(kernel, grid, block, args, x.device)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: bf16 [T, H], H a multiple of 8 up to 16384; weight: bf16 [H].

    Writes the new residual bf16(x + residual) into `residual` IN PLACE and
    returns (out, residual) with out = rms_norm(new residual, zero_centred=...),
    bf16 [T, H].
    out may be x itself but must not overlap residual.
    """
    tokens, hidden = _check_rows("x", x)
    check_cuda_tensor("residual", residual, dtype=torch.bfloat16, ndim=2, device=x.device)
    if residual.shape != x.shape:
        raise ValueError(f"residual must be {tuple(x.shape)}, got {tuple(residual.shape)}")
    _check_aligned("residual", residual)
    _check_weight(weight, hidden, x.device)
    out = _check_or_make_out(out, x)
    if tokens and tensors_overlap(out, residual):
        raise ValueError("out must not overlap residual (both are written)")
    if tokens == 0:
        return out, residual
    suffix, grid, block = _layout(hidden, tokens)
    kernel = load_kernel(_SOURCE, _kernel_name(True, zero_centred, suffix), x.device.index or 0)
    args = (ptr(out), ptr(residual), ptr(x), ptr(weight), np.int32(tokens), np.int32(hidden),
            np.float32(1.0 / hidden), np.float32(eps))
    launch(kernel, grid, block, args, x.device)
    return out, residual
