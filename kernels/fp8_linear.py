"""FP8 weights on the GPU: float8 e4m3 values [N, K] with float32 scales per
128 x 128 block (kernels/fp8_reference.py has the layout and the reference).

- fp8_gemv(x, weight, scales): out = x @ dequantize(weight, scales).T for 1
  to FP8_GEMV_MAX_ROWS rows of x. Each weight byte is read from HBM once per
  call whatever M is; values go to the tensor cores exactly (as bf16) and the
  block scales are applied in float32 (kernels/csrc/fp8_linear.cu explains
  how), so the result is the float32 matmul of the dequantized weight up to
  the rounding of value * scale and float32 accumulation order, rounded once
  to bf16.
- dequantize_to(weight, scales, out): out = dequantize(weight, scales)
  rounded to bf16, bit for bit.
- fp8_linear(x, weight, scales): the one to call from a model: the GEMV for
  few rows, else dequantize into a scratch buffer and a bf16 cuBLAS GEMM.

NOTE: torch._scaled_mm could run the large-M case on FP8 tensor cores with
the activations quantized too; it is not used because its block-scale
support on sm_90 could not be checked here, and quantizing x would change
the numbers the GEMV path and the reference give.

CUDA-graph safe with `out` (and `scratch`) given: nothing is allocated,
nothing syncs, and the launch grids depend only on the shapes (and the
device's SM count).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.cuda_build import (
    check_cuda_tensor,
    check_gemv_x,
    check_row_strided_out,
    device_index_of,
    gemv_out,
    launch,
    load_kernel,
    ptr,
    sm_count,
    tensors_overlap,
)
from kernels.fp8_reference import FP8, FP8_BLOCK, scale_shape

# 16 = two n8 tiles of the mma: batches of 9-16 rows also read the weight
# bytes once instead of writing and re-reading a bf16 copy (3x the bytes).
FP8_GEMV_MAX_ROWS = 16

_SOURCE = "fp8_linear.cu"
_ROWS_PER_CTA = 16
# Warps per CTA: 8 when the grid fills the chip; 16 when there are fewer CTAs
# than SMs, so more of K is in flight (the .cu file's kMaxWarps).
_WARPS_MANY_CTAS = 8
_WARPS_FEW_CTAS = 16
_DEQUANT_THREADS = 256
_MAX_INDEX = 2**31 - 1


def fp8_shape_supported(n: int, k: int) -> bool:
    """Whether the kernels take a weight [n, k]: whole 128-column blocks and
    indices within int32."""
    return n >= 1 and k >= FP8_BLOCK and k % FP8_BLOCK == 0 and n * k <= _MAX_INDEX


def _check_weight(weight: torch.Tensor, scales: torch.Tensor,
                  device: torch.device | None) -> tuple[int, int]:
    """Validate weight [N, K] e4m3 and scales [ceil(N/128), K/128] float32;
    returns (N, K)."""
    check_cuda_tensor("weight", weight, dtype=FP8, ndim=2, device=device)
    check_cuda_tensor("scales", scales, dtype=torch.float32, ndim=2, device=weight.device)
    n, k = weight.shape
    if not fp8_shape_supported(n, k):
        raise ValueError(f"weight must be [N, K] with K a positive multiple of {FP8_BLOCK} "
                         f"and N * K < 2^31, got {tuple(weight.shape)}")
    if tuple(scales.shape) != scale_shape(n, k):
        raise ValueError(f"scales must be {scale_shape(n, k)} for weight {tuple(weight.shape)}, "
                         f"got {tuple(scales.shape)}")
    if weight.data_ptr() % 16:
        raise ValueError("weight must start at a 16-byte aligned address")
    return n, k


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(weight, scales).T for a few rows of x.

    x: bf16 [M, K], 1 <= M <= FP8_GEMV_MAX_ROWS, contiguous, 16-byte aligned;
    weight: float8_e4m3fn [N, K] contiguous on x's device, 16-byte aligned;
    scales: float32 [ceil(N/128), K/128]. Returns (or fills) out, bf16
    [M, N]: its rows contiguous, possibly a column range of a wider output
    (row stride >= N); it must not overlap x, weight or scales. Raises
    ValueError for anything else.
    """
    rows, k = check_gemv_x(x, FP8_GEMV_MAX_ROWS)
    n, weight_k = _check_weight(weight, scales, x.device)
    if weight_k != k:
        raise ValueError(f"x must be [M, {weight_k}] for weight {tuple(weight.shape)}, "
                         f"got {tuple(x.shape)}")
    out, out_stride = gemv_out(out, rows, n, x, (x, weight, scales), "x, weight or scales")
    index = device_index_of(x)
    ctas = -(-n // _ROWS_PER_CTA)
    most = _WARPS_MANY_CTAS if ctas >= sm_count(index) else _WARPS_FEW_CTAS
    warps = max(1, min(most, k // FP8_BLOCK))
    tiles = 1 if rows <= 8 else 2
    kernel = load_kernel(_SOURCE, f"fp8_gemv_nt{tiles}", index)
    args = (ptr(out), ptr(x), ptr(weight), ptr(scales), np.int32(n), np.int32(k),
            np.int32(rows), np.int32(out_stride))
    launch(kernel, (ctas,), (32 * warps,), args, x.device)
    return out


def dequantize_to(weight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Fill bf16 out [N, K] with dequantize(weight, scales) rounded to bf16
    (round to nearest even), exactly. Returns out."""
    check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=2)
    n, k = _check_weight(weight, scales, out.device)
    if tuple(out.shape) != (n, k):
        raise ValueError(f"out must be {(n, k)} to match weight, got {tuple(out.shape)}")
    if out.data_ptr() % 16:
        raise ValueError("out must start at a 16-byte aligned address")
    if tensors_overlap(out, weight) or tensors_overlap(out, scales):
        raise ValueError("out must not overlap weight or scales")
    index = device_index_of(out)
    groups = n * k // 16
    ctas = max(1, min(-(-groups // _DEQUANT_THREADS), 32 * sm_count(index)))
    kernel = load_kernel(_SOURCE, "fp8_dequantize", index)
    args = (ptr(out), ptr(weight), ptr(scales), np.int32(groups), np.int32(k))
    launch(kernel, (ctas,), (_DEQUANT_THREADS,), args, out.device)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
               out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, dequantize(weight, scales)) for any number of rows of x.

    M <= FP8_GEMV_MAX_ROWS: fp8_gemv (reads the weight bytes once).
    Otherwise the weight is dequantized into scratch (a bf16 buffer of at
    least N * K elements; the engine shares one across its layers; allocated
    when None) and multiplied by cuBLAS. out as in fp8_gemv.
    """
    check_cuda_tensor("x", x, dtype=torch.bfloat16, ndim=2)
    rows = x.shape[0]
    if rows <= FP8_GEMV_MAX_ROWS:
        return fp8_gemv(x, weight, scales, out=out)
    n, k = _check_weight(weight, scales, x.device)
    if x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for weight {tuple(weight.shape)}, "
                         f"got {tuple(x.shape)}")
    if scratch is None:
        scratch = torch.empty(n * k, dtype=torch.bfloat16, device=x.device)
    else:
        check_cuda_tensor("scratch", scratch, dtype=torch.bfloat16, ndim=scratch.dim(),
                          device=x.device)
        if scratch.numel() < n * k:
            raise ValueError(f"scratch must hold at least {n * k} elements, got {scratch.numel()}")
    dense = dequantize_to(weight, scales, scratch.view(-1)[: n * k].view(n, k))
    if out is None:
        return F.linear(x, dense)
    check_row_strided_out(out, rows, n, x.device)
    if out.is_contiguous():
        # The same cuBLAS call as F.linear without a bias (x @ dense.T), into out.
        return torch.mm(x, dense.t(), out=out)
    # A column range of a wider output: cuBLAS writes a temporary.
    return out.copy_(F.linear(x, dense))
