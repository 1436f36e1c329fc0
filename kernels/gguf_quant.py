"""GGUF quantized weights on the GPU in their packed block layout: a fused
dequantize-in-registers GEMV for decode and a full dequantize for prefill.

The packed weight is the tensor's bytes from the GGUF file, reshaped to
[N, row_bytes] (row n = the K/block_size blocks of output row n); nothing is
repacked. Types: GGUF_KERNEL_TYPES (ids as in gguf.GGMLQuantizationType).

- quant_gemv(x, packed, qtype): out = x @ dequantize(packed).T for 1 to
  QUANT_GEMV_MAX_ROWS rows of x. Each packed byte is read from HBM once per
  call whatever M is; the block integers become floats exactly and the block
  scales are applied in float32, so the result is the float32 matmul of
  gguf's dequantized weight up to float32 accumulation order, rounded once to
  bf16. Up to CUDA_CORE_GEMV_ROWS[type] rows (where measured faster) run on
  the CUDA cores (quant_gemv_cuda_cores, kernels/csrc/gguf_gemv_small.cu: weight straight
  into registers, float32 FMAs), more rows on the tensor cores
  (quant_gemv_tensor_cores, kernels/csrc/gguf_quant.cu).
- dequantize_to(packed, qtype, out): out = gguf's dequantized values rounded
  to bf16, bit for bit.
- quant_linear(x, packed, qtype, k): the one to call from a model: the GEMV
  for few rows, else dequantize into a scratch buffer and F.linear (cuBLAS).
  Measured in tests/perf/bench_gguf_quant.py against a bf16 F.linear.

CUDA-graph safe with `out` (and `scratch`) given: nothing is allocated,
nothing syncs, and the launch grids depend only on the shapes (and the
device's SM count).
"""

from __future__ import annotations

import functools

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
    set_max_dynamic_shared,
    sm_count,
    tensors_overlap,
)

GGUF_KERNEL_TYPES: dict[int, str] = {2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

# 16 = two n8 tiles of the mma: batches of 9-16 rows also read the packed
# bytes once instead of writing and re-reading a bf16 copy (4-8x the bytes).
QUANT_GEMV_MAX_ROWS = 16
# The CUDA-core kernel takes up to this many rows (where its staged x fits,
# cuda_core_gemv_fits).
CUDA_CORE_GEMV_MAX_ROWS = 4
# Per type, up to how many rows quant_gemv picks it over the tensor-core
# kernel: where it measured faster, summed over a layer's projections at
# the Qwen3-8B shape (tests/perf/bench_gguf_quant.py on the H200,
# 2026-12-02, docs/performance.md). One row: Q4_K 63 against 70 us, Q6_K
# 103 against 117; from two rows on, and for Q8_0 (137 against 129 us) and
# Q4_0 (its blocks are Q8_0's, half the bytes), the tensor cores win.
CUDA_CORE_GEMV_ROWS: dict[int, int] = {8: 0, 2: 0, 12: 1, 13: 1, 14: 1}

# qtype -> (elements per block, bytes per block), as in gguf's GGML_QUANT_SIZES.
_BLOCK: dict[int, tuple[int, int]] = {2: (32, 18), 8: (32, 34), 12: (256, 144), 13: (256, 176),
                                      14: (256, 210)}


def _warp_shared_bytes(unit_bytes: int, max_offset: int, groups: int, stages: int) -> int:
    """Shared memory of one GEMV warp, as Geometry<T>::kWarpBytes in the .cu
    file: `stages` ring slots of 16 rows, each row an odd number of 16-byte
    chunks covering a unit's bytes at any misalignment, then the scale table
    (16 rows x groups float2)."""
    chunks = (unit_bytes + max_offset + 15) // 16
    return stages * 16 * (chunks | 1) * 16 + 16 * groups * 8


# qtype -> shared bytes per warp (the .cu file's per-type constants).
_WARP_SHARED: dict[int, int] = {
    8: _warp_shared_bytes(272, 14, 8, 2),
    2: _warp_shared_bytes(144, 14, 8, 3),
    12: _warp_shared_bytes(144, 0, 8, 3),
    13: _warp_shared_bytes(176, 0, 8, 3),
    14: _warp_shared_bytes(210, 14, 16, 3),
}
_SOURCE = "gguf_quant.cu"
_ROWS_PER_CTA = 16
_UNIT = 256  # K elements per warp step
# Warps per CTA: 8 when the grid fills the chip several times (CTAs share
# SMs); up to 16 when there are fewer CTAs than SMs, so more of K is in flight.
_WARPS_MANY_CTAS = 8
_WARPS_FEW_CTAS = 16
_DEQUANT_THREADS = 256
_MAX_INDEX = 2**31 - 1

# The CUDA-core kernel (gguf_gemv_small.cu): one CTA of 32 warps per SM,
# 8-row tiles, warps grouped into slots of W that share a tile (at most 15
# slots: one named barrier each). It stages x as float32 in shared memory;
# what it leaves of the SM's 256 KiB stays L1, which holds the weight loads
# in flight, hence a cap below the device's own limit.
_SMALL_SOURCE = "gguf_gemv_small.cu"
_SMALL_TILE_ROWS = 8
_SMALL_WARPS = 32
_SMALL_MAX_SLOTS = 15
_SMALL_SHARED_LIMIT = 160 * 1024
# qtype -> (elements per scale group, whether the kernel keeps sums of x per group)
_SMALL_GROUPS: dict[int, tuple[int, bool]] = {8: (32, False), 2: (32, True), 12: (32, True),
                                              13: (32, True), 14: (16, True)}


def _require_type(qtype: int) -> str:
    if qtype not in GGUF_KERNEL_TYPES:
        names = ", ".join(f"{k} ({v})" for k, v in GGUF_KERNEL_TYPES.items())
        raise ValueError(f"qtype {qtype} has no GPU kernel; supported: {names}")
    return GGUF_KERNEL_TYPES[qtype]


def packed_row_bytes(qtype: int, k: int) -> int:
    """Bytes of one weight row of K elements in qtype's GGUF block layout."""
    _require_type(qtype)
    block, size = _BLOCK[qtype]
    if k <= 0 or k % block:
        raise ValueError(f"K must be a positive multiple of {block} for "
                         f"{GGUF_KERNEL_TYPES[qtype]}, got {k}")
    return k // block * size


def _check_packed(packed: torch.Tensor, qtype: int, k: int, device: torch.device | None) -> int:
    """Validate packed [N, packed_row_bytes(qtype, k)]; returns N."""
    check_cuda_tensor("packed", packed, dtype=torch.uint8, ndim=2, device=device)
    row_bytes = packed_row_bytes(qtype, k)
    if packed.shape[1] != row_bytes:
        raise ValueError(f"packed must be [N, {row_bytes}] for K={k} in "
                         f"{GGUF_KERNEL_TYPES[qtype]}, got {tuple(packed.shape)}")
    # Q4_K/Q5_K rows are multiples of 16 bytes: the kernel reads them in
    # aligned 16-byte pieces. The other types' rows (and so a slice of rows)
    # are only 2-byte aligned, which the kernel handles.
    alignment = 16 if qtype in (12, 13) else 2
    if packed.data_ptr() % alignment:
        raise ValueError(f"packed must start at a {alignment}-byte aligned address")
    n = packed.shape[0]
    if not 1 <= n <= _MAX_INDEX // k:
        raise ValueError(f"packed has {n} rows; 1 to {_MAX_INDEX // k} are supported")
    return n


def _gemv_layout(n: int, k: int, qtype: int, sms: int) -> tuple[int, int, int, int]:
    """(CTAs, warps per CTA, blocks per row, units per row)."""
    block = _BLOCK[qtype][0]
    blocks = k // block
    units = -(-k // _UNIT)
    ctas = -(-n // _ROWS_PER_CTA)
    most = _WARPS_MANY_CTAS if ctas >= sms else _WARPS_FEW_CTAS
    warps = max(1, min(most, units))
    return ctas, warps, blocks, units


@functools.lru_cache(maxsize=4096)  # called per launch
def _small_layout(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(CTAs, warps per tile W, tile slots per CTA) of the CUDA-core kernel.

    W warps split a tile's K units; W is the one with the fewest unit-steps
    per warp over all rounds of tiles, the smallest among equals. Where K has
    at most 8 units and the tiles fit one round, that is W = units whatever N
    is, so row slices of such a weight sum in the same order (same bits)."""
    units = -(-k // _UNIT)
    tiles = -(-n // _SMALL_TILE_ROWS)
    ctas = min(sms, tiles)
    best: tuple[int, int, int] | None = None
    for warps in range(1, min(units, _SMALL_WARPS) + 1):
        slots = _SMALL_WARPS if warps == 1 else min(_SMALL_WARPS // warps, _SMALL_MAX_SLOTS)
        cost = -(-tiles // (ctas * slots)) * -(-units // warps)
        if best is None or cost < best[0]:
            best = (cost, warps, slots)
    assert best is not None
    return ctas, best[1], best[2]


def _small_shared_bytes(rows: int, k: int, qtype: int, warps: int, slots: int) -> int:
    """Dynamic shared memory of the CUDA-core kernel, as gguf_gemv_small.cu
    lays it out: x as float32 with 4 floats of padding per 64, the sums of x
    per scale group (rows padded to 4), and the reduction scratch (two
    buffers of slots x W warps x 8 rows x M)."""
    group, sums = _SMALL_GROUPS[qtype]
    x_floats = rows * (k + 4 * -(-k // 64))
    sum_floats = rows * ((k // group + 3) & ~3) if sums else 0
    return 4 * (x_floats + sum_floats + 2 * slots * warps * _SMALL_TILE_ROWS * rows)


def cuda_core_gemv_fits(rows: int, n: int, k: int, qtype: int, sms: int,
                        shared_limit: int = _SMALL_SHARED_LIMIT) -> bool:
    """Whether quant_gemv_cuda_cores takes x [rows, k] against an [n, k]
    weight: at most CUDA_CORE_GEMV_MAX_ROWS rows, and its shared memory
    (mostly the staged x) within shared_limit."""
    _require_type(qtype)
    if not 1 <= rows <= CUDA_CORE_GEMV_MAX_ROWS or n < 1 or k < 1:
        return False
    _, warps, slots = _small_layout(n, k, sms)
    return _small_shared_bytes(rows, k, qtype, warps, slots) <= shared_limit


@functools.cache
def _shared_limit(device_index: int) -> int:
    """The CUDA-core kernel's shared-memory cap on this device."""
    props = torch.cuda.get_device_properties(device_index)
    return min(_SMALL_SHARED_LIMIT, getattr(props, "shared_memory_per_block_optin", 48 * 1024))


def _gemv_arguments(x: torch.Tensor, packed: torch.Tensor, qtype: int, out: torch.Tensor | None,
                    max_rows: int) -> tuple[str, int, int, torch.Tensor, int]:
    """Check a GEMV's arguments: (type name, N, K, out, out's row stride),
    out allocated when None."""
    name = _require_type(qtype)
    rows, k = check_gemv_x(x, max_rows)
    n = _check_packed(packed, qtype, k, x.device)
    out, out_stride = gemv_out(out, rows, n, x, (x, packed), "x or packed")
    return name, n, k, out, out_stride


def quant_gemv(x: torch.Tensor, packed: torch.Tensor, qtype: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(packed).T for a few rows of x.

    x: bf16 [M, K], 1 <= M <= QUANT_GEMV_MAX_ROWS, contiguous, 16-byte
    aligned; packed: uint8 [N, packed_row_bytes(qtype, K)], contiguous, on
    x's device, 16-byte aligned for Q4_K/Q5_K and 2-byte aligned otherwise (a
    slice of rows is fine). Returns (or fills) out, bf16 [M, N]: its rows
    contiguous, possibly a column range of a wider output (row stride >= N);
    it must not overlap x or packed. Raises ValueError for anything else.
    Up to CUDA_CORE_GEMV_ROWS[qtype] rows (where cuda_core_gemv_fits) run on
    the CUDA cores, the others on the tensor cores.
    """
    if (x.is_cuda and x.dim() == 2 and packed.dim() == 2
            and x.shape[0] <= CUDA_CORE_GEMV_ROWS.get(qtype, 0)):
        index = device_index_of(x)
        if cuda_core_gemv_fits(x.shape[0], packed.shape[0], x.shape[1], qtype, sm_count(index),
                               _shared_limit(index)):
            return quant_gemv_cuda_cores(x, packed, qtype, out=out)
    return quant_gemv_tensor_cores(x, packed, qtype, out=out)


def quant_gemv_cuda_cores(x: torch.Tensor, packed: torch.Tensor, qtype: int,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """quant_gemv on the CUDA cores (kernels/csrc/gguf_gemv_small.cu), for
    1 to CUDA_CORE_GEMV_MAX_ROWS rows of x whose staged copy fits
    (cuda_core_gemv_fits); arguments as quant_gemv."""
    name, n, k, out, out_stride = _gemv_arguments(x, packed, qtype, out, CUDA_CORE_GEMV_MAX_ROWS)
    rows = x.shape[0]
    index = device_index_of(x)
    ctas, warps, slots = _small_layout(n, k, sm_count(index))
    shared = _small_shared_bytes(rows, k, qtype, warps, slots)
    if shared > _shared_limit(index):
        raise ValueError(f"x [{rows}, {k}] does not fit the CUDA-core GEMV's shared memory "
                         f"({shared} > {_shared_limit(index)} bytes); use quant_gemv")
    kernel = load_kernel(_SMALL_SOURCE, f"gguf_gemv_small_{name}_m{rows}", index)
    set_max_dynamic_shared(kernel, shared)
    args = (ptr(out), ptr(x), ptr(packed), np.int32(n), np.int32(k),
            np.int32(k // _BLOCK[qtype][0]), np.int32(out_stride), np.int32(warps), np.int32(slots))
    launch(kernel, (ctas,), (32 * warps * slots,), args, x.device, shared_bytes=shared)
    return out


def quant_gemv_tensor_cores(x: torch.Tensor, packed: torch.Tensor, qtype: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """quant_gemv on the tensor cores (kernels/csrc/gguf_quant.cu), for 1 to
    QUANT_GEMV_MAX_ROWS rows of x; arguments as quant_gemv."""
    name, n, k, out, out_stride = _gemv_arguments(x, packed, qtype, out, QUANT_GEMV_MAX_ROWS)
    rows = x.shape[0]
    index = device_index_of(x)
    ctas, warps, blocks, units = _gemv_layout(n, k, qtype, sm_count(index))
    tiles = 1 if rows <= 8 else 2
    # Warp w sums x-row tile w over the warps' partials at the end: 9..16
    # rows need two warps even where K is one unit (the second idles in K).
    warps = max(warps, tiles)
    kernel = load_kernel(_SOURCE, f"gguf_gemv_{name}_nt{tiles}", index)
    shared = warps * _WARP_SHARED[qtype]
    set_max_dynamic_shared(kernel, shared)
    args = (ptr(out), ptr(x), ptr(packed), np.int32(n), np.int32(k), np.int32(rows),
            np.int32(blocks), np.int32(units), np.int32(out_stride))
    launch(kernel, (ctas,), (32 * warps,), args, x.device, shared_bytes=shared)
    return out


def dequantize_to(packed: torch.Tensor, qtype: int, out: torch.Tensor) -> torch.Tensor:
    """Fill bf16 out [N, K] with dequantize(packed): gguf's float32 values
    rounded to bf16 (round to nearest even), exactly. Returns out."""
    name = _require_type(qtype)
    check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=2)
    n_out, k = out.shape
    n = _check_packed(packed, qtype, k, out.device)
    if n_out != n:
        raise ValueError(f"out must have {n} rows to match packed, got {tuple(out.shape)}")
    if out.data_ptr() % 16:
        raise ValueError("out must start at a 16-byte aligned address")
    if tensors_overlap(out, packed):
        raise ValueError("out must not overlap packed")
    index = device_index_of(out)
    groups = n * k // 8
    ctas = max(1, min(-(-groups // _DEQUANT_THREADS), 32 * sm_count(index)))
    kernel = load_kernel(_SOURCE, f"gguf_dequantize_{name}", index)
    args = (ptr(out), ptr(packed), np.int32(n), np.int32(k), np.int32(k // _BLOCK[qtype][0]))
    launch(kernel, (ctas,), (_DEQUANT_THREADS,), args, out.device)
    return out


def quant_linear(x: torch.Tensor, packed: torch.Tensor, qtype: int, k: int,
                 out: torch.Tensor | None = None,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, dequantize(packed)) for any number of rows of x [M, k].

    M <= QUANT_GEMV_MAX_ROWS: quant_gemv (reads the packed bytes once).
    Otherwise the weight is dequantized into scratch (a bf16 buffer of at
    least N * k elements, 16-byte aligned; the engine shares one across its
    layers; allocated when None) and multiplied by cuBLAS. out as in
    quant_gemv (rows contiguous, row stride >= N).
    """
    _require_type(qtype)
    check_cuda_tensor("x", x, dtype=torch.bfloat16, ndim=2)
    if x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    rows = x.shape[0]
    if rows <= QUANT_GEMV_MAX_ROWS:
        return quant_gemv(x, packed, qtype, out=out)
    n = _check_packed(packed, qtype, k, x.device)
    if scratch is None:
        scratch = torch.empty(n * k, dtype=torch.bfloat16, device=x.device)
    else:
        check_cuda_tensor("scratch", scratch, dtype=torch.bfloat16, ndim=scratch.dim(),
                          device=x.device)
        if scratch.numel() < n * k:
            raise ValueError(f"scratch must hold at least {n * k} elements, got {scratch.numel()}")
    weight = scratch.view(-1)[: n * k].view(n, k)
    if out is not None:
        check_row_strided_out(out, rows, n, x.device)
    dequantize_to(packed, qtype, weight)
    if out is None:
        return F.linear(x, weight)
    if out.is_contiguous():
        # The same cuBLAS call as F.linear without a bias (x @ weight.T), into out.
        return torch.mm(x, weight.t(), out=out)
    # A column range of a wider output: cuBLAS writes a temporary.
    return out.copy_(F.linear(x, weight))
