"""Skinny GEMM (GEMV with 1..8 rows) for decode steps: torch.nn.functional.linear
for bf16 x [M, K], M <= 8, on the tensor cores at the speed of streaming the weight.

At decode batch sizes a projection is memory-bound: each weight element is read
from HBM once and used for every row of x. The kernel (kernels/csrc/skinny_gemm.cu)
splits the weight into CTAs of 8 or 16 output rows by the whole of K, splits K
between the CTA's warps so that every warp's loads are in flight at once, and
sums the warps' float32 partials in shared memory in a fixed order
(deterministic). Numerics: bf16 products accumulated in float32, + bias in
float32, one rounding to bf16, as cuBLAS does for F.linear.

skinny_linear_rows is the batch-invariant form (--deterministic): any number
of rows, each computed with the same arithmetic whatever the others are. The
same kernel body loops over up to 8 tiles of 8 rows while each weight
fragment is in registers, so the weight is read once per 64 rows; the K
split (warps and their steps) is a function of K alone (rows_k_split), and a
row's accumulators, their order and the warps' reduction order depend on
nothing else, so a row comes out bit for bit the same alone, in any batch,
in any chunk of a prompt (tests/kernels/test_batch_invariant_kernels_gpu.py).

CUDA-graph safe: with `out` given nothing is allocated, nothing syncs, and the
launch grid depends only on the shapes (and the device's SM count).
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
    sm_count,
    tensors_overlap,
)

SKINNY_MAX_ROWS = 8

_SOURCE = "skinny_gemm.cu"
_VECTOR = 8  # bf16 per 16-byte access: K must be a multiple of it
_STEP_K = 128  # K elements one warp covers per loop step (4 x 16 bytes per thread)
_ROWS_PER_GROUP = 8  # weight rows per mma (its N dimension)
# Warps per CTA: 8 when there are at least as many CTAs as SMs (several CTAs
# then share an SM and the grid fills the chip); up to 32 (one 1024-thread CTA
# per SM, only with one row group) when N is too small for that, so that
# splitting K between more warps keeps more of the matrix in flight.
_WARPS_MANY_CTAS = 8
_WARPS_FEW_CTAS = 32
# Keep the kernel's int32 index math (k offsets, steps * 128, row numbers of
# the last CTA) far from overflow.
_MAX_K = 2**30
_MAX_N = 2**30
# skinny_linear_rows: the most x rows (row numbers stay int32 in the kernel).
SKINNY_ROWS_LIMIT = 2**30


def _layout(rows: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(row groups per CTA, CTAs, warps per CTA, steps of 128 K) for weight [rows, k].

    16 rows per CTA (two mma row groups sharing each x fragment, half the x
    loads) when that still gives at least one CTA per SM, else 8 rows.
    The steps are spread evenly over the warps: each warp does
    ceil(steps / warps) of them, with no warp idle.
    """
    row_groups = 2 if -(-rows // (2 * _ROWS_PER_GROUP)) >= sms else 1
    ctas = -(-rows // (row_groups * _ROWS_PER_GROUP))
    # (Two row groups only come with ctas >= sms; their kernel takes <= 8 warps.)
    max_warps = _WARPS_MANY_CTAS if ctas >= sms or row_groups == 2 else _WARPS_FEW_CTAS
    warps, steps = k_split(k, max_warps)
    return row_groups, ctas, warps, steps


def k_split(k: int, max_warps: int) -> tuple[int, int]:
    """(warps, steps of 128 K): the steps of K spread evenly over at most
    max_warps warps (warp w takes steps w, w + warps, ...), none idle."""
    steps = -(-k // _STEP_K)
    steps_per_warp = -(-steps // max_warps)
    return -(-steps // steps_per_warp), steps


# skinny_linear_rows: at most this many warps per CTA, whatever the shapes
# (its K split must not depend on the SM count or N), tiles of 8 rows per CTA
# as powers of two up to 8 (64 rows), and chunks of rows that take each CTA's
# weight rows in turn, so their x stays in L2 while the weight streams once.
ROWS_MAX_WARPS = 8
_ROW_TILES = (1, 2, 4, 8)
_GROUP_CHUNKS = 8


def rows_k_split(k: int) -> tuple[int, int]:
    """(warps, steps of 128 K) with which skinny_linear_rows sums a row over
    K: the steps spread evenly over at most ROWS_MAX_WARPS warps (warp w
    takes steps w, w + warps, ...), then the warps' partials added in warp
    order. A function of K alone: this is each row's reduction order."""
    return k_split(k, ROWS_MAX_WARPS)


def _rows_layout(rows: int, n: int, sms: int) -> tuple[int, int, int, int]:
    """(tiles of 8 rows per CTA, row groups per CTA, CTAs per chunk, chunks)
    for skinny_linear_rows: performance choices only (none changes a row's
    arithmetic). Two row groups (half the x loads) when the grid still
    fills the chip."""
    needed = -(-rows // 8)
    tiles = next((t for t in _ROW_TILES if t >= needed), _ROW_TILES[-1])
    chunks = -(-rows // (8 * tiles))
    row_groups = 2 if -(-n // (2 * _ROWS_PER_GROUP)) * chunks >= sms else 1
    return tiles, row_groups, -(-n // (row_groups * _ROWS_PER_GROUP)), chunks


def _aligned(tensor: torch.Tensor) -> bool:
    # The kernel reads x and the weight in 16-byte vectors.
    return tensor.data_ptr() % 16 == 0


def skinny_weight_supported(weight: torch.Tensor, device: torch.device) -> bool:
    """Whether weight can be a skinny GEMM's matrix on device: bf16 [N, K],
    1 <= N, K a positive multiple of 8, contiguous, 16-byte aligned (a cheap
    host-side check; skinny_linear_supported adds x's)."""
    if not (weight.is_cuda and weight.device == device and weight.dtype == torch.bfloat16):
        return False
    if weight.dim() != 2:
        return False
    n, k = weight.shape
    if not 1 <= n <= _MAX_N or k < _VECTOR or k % _VECTOR or k > _MAX_K:
        return False
    return weight.is_contiguous() and _aligned(weight)


def skinny_linear_supported(x: torch.Tensor, weight: torch.Tensor,
                            max_rows: int = SKINNY_MAX_ROWS) -> bool:
    """Whether skinny_linear takes (x, weight): a cheap host-side check of
    shapes, dtypes, devices, layout and alignment only (no sync).

    x must be bf16 [M, K], 1 <= M <= max_rows (skinny_linear_rows:
    SKINNY_ROWS_LIMIT), contiguous, 16-byte aligned; weight bf16 [N, K], N >= 1,
    contiguous, 16-byte aligned, on x's CUDA device; K a positive multiple
    of 8.
    """
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2):
        return False
    if not skinny_weight_supported(weight, x.device):
        return False
    rows, k = x.shape
    if not 1 <= rows <= max_rows or weight.shape[1] != k:
        return False
    return x.is_contiguous() and _aligned(x)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for a few rows.

    x: bf16 [M, K], 1 <= M <= SKINNY_MAX_ROWS, K a multiple of 8;
    weight: bf16 [N, K] (torch's Linear layout); bias: optional bf16 [N].
    Returns (or fills) out, bf16 [M, N] = x @ weight.T (+ bias), products of
    bf16 accumulated in float32 and rounded to bf16 once. out must not overlap
    the inputs. Raises ValueError for anything else (callers check
    skinny_linear_supported and fall back to F.linear).
    """
    out = _checked_out(x, weight, bias, out, SKINNY_MAX_ROWS)
    rows, k = x.shape
    n = weight.shape[0]
    device_index = device_index_of(x)
    row_groups, ctas, warps, steps = _layout(n, k, sm_count(device_index))
    kernel = load_kernel(_SOURCE, f"skinny_gemm_m{rows}_rg{row_groups}", device_index)
    args = (
        ptr(out),
        ptr(x),
        ptr(weight),
        ptr(bias) if bias is not None else np.uint64(0),
        np.int32(n),
        np.int32(k),
        np.int32(steps),
    )
    launch(kernel, (ctas,), (32 * warps,), args, x.device)
    return out


def skinny_linear_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for any number of rows, batch-invariant:
    each row of out is bit for bit what this function gives for that row
    alone (the same K split and reduction order, rows_k_split(K), whatever
    M is). Arguments and numerics as skinny_linear, but x may have 1 to
    SKINNY_ROWS_LIMIT rows."""
    out = _checked_out(x, weight, bias, out, SKINNY_ROWS_LIMIT)
    rows, k = x.shape
    n = weight.shape[0]
    device_index = device_index_of(x)
    tiles, row_groups, ctas, chunks = _rows_layout(rows, n, sm_count(device_index))
    warps, steps = rows_k_split(k)
    if ctas * chunks >= 2**31:
        raise ValueError(f"x [{rows}, {k}] @ weight [{n}, {k}]^T needs too many CTAs for one launch")
    kernel = load_kernel(_SOURCE, f"skinny_rows_t{tiles}_rg{row_groups}", device_index)
    args = (
        ptr(out),
        ptr(x),
        ptr(weight),
        ptr(bias) if bias is not None else np.uint64(0),
        np.int32(n),
        np.int32(k),
        np.int32(steps),
        np.int32(rows),
        np.int32(chunks),
        np.int32(_GROUP_CHUNKS),
    )
    launch(kernel, (ctas * chunks,), (32 * warps,), args, x.device)
    return out


def _checked_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None, max_rows: int) -> torch.Tensor:
    """Checks the arguments of a skinny GEMM of at most max_rows rows of x;
    returns out, allocated when None."""
    check_cuda_tensor("x", x, dtype=torch.bfloat16, ndim=2)
    check_cuda_tensor("weight", weight, dtype=torch.bfloat16, ndim=2, device=x.device)
    rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= rows <= max_rows:
        raise ValueError(f"x must have 1 to {max_rows} rows, got {rows}")
    if weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}] to match x, got {tuple(weight.shape)}")
    if k < _VECTOR or k % _VECTOR or k > _MAX_K:
        raise ValueError(f"K must be a positive multiple of {_VECTOR} up to {_MAX_K}, got {k}")
    if not 1 <= n <= _MAX_N:
        raise ValueError(f"weight must have 1 to {_MAX_N} rows, got {n}")
    if not _aligned(x):
        raise ValueError("x must start at a 16-byte aligned address")
    if not _aligned(weight):
        raise ValueError("weight must start at a 16-byte aligned address")
    if bias is not None:
        check_cuda_tensor("bias", bias, dtype=torch.bfloat16, ndim=1, device=x.device)
        if bias.shape[0] != n:
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((rows, n), dtype=torch.bfloat16, device=x.device)
    else:
        check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=2, device=x.device)
        if out.shape != (rows, n):
            raise ValueError(f"out must be {(rows, n)}, got {tuple(out.shape)}")
        # Other CTAs may still read x, the weight or the bias after one has
        # written its outputs.
        inputs = [x, weight] if bias is None else [x, weight, bias]
        if any(tensors_overlap(out, tensor) for tensor in inputs):
            raise ValueError("out must not overlap x, weight or bias")
    return out
