"""Causal prefill attention over the paged KV cache on the GPU's tensor cores.

Reference: kernels.reference.paged_attention (same semantics: a flat varlen
batch, each sequence's new tokens the last q_len of its seq_len cached ones,
causal mask aligned bottom-right, decode rows with q_len 1 mixed in). The
kernel (kernels/csrc/prefill_attention.cu) is flash-attention style: one block
per (tile of 128 packed (token, query head) rows, sequence, kv head), K/V tiles
of 32 or 64 tokens gathered from the pages into shared memory, mma.sync bf16
with float32 accumulation and an online float32 softmax. Head dims 64, 128
and 256 are built (256: the "w16" shape only, 192 KB of shared memory).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from kernels.cuda_build import (
    check_cuda_tensor,
    launch,
    load_kernel,
    ptr,
    set_max_dynamic_shared,
)
from kernels.kv_cache_dtype import check_kv_caches, reader_scales

_SOURCE = "prefill_attention.cu"
_BLOCK_M = 128  # packed (token, query head) rows per block (kBlockM)
_HEAD_DIMS = (64, 128, 256)
_MAX_GRID_Y = 65535
_INT32_MAX = 2**31 - 1


class _Shape(NamedTuple):
    """A compiled kernel shape (Shape<...> in the .cu, same numbers)."""

    threads: int
    block_n: int  # keys per shared-memory tile
    stages: int  # K/V tiles in flight

    def shared_bytes(self, head_dim: int) -> int:
        # One Q tile plus `stages` (K tile, V tile) pairs, all bf16.
        return (_BLOCK_M + self.stages * 2 * self.block_n) * head_dim * 2


# "w32": 4 warps of 32 rows, two blocks an SM (less shared-memory traffic per
# FLOP); "w16": 8 warps of 16 rows (twice the warps for a grid too small to
# give every SM two w32 blocks). D = 256 has w16 only, one block an SM: its
# output accumulator is 128 registers a thread at 16 rows (32 rows would not
# fit), and (128 + 2 * 2 * 64) * 256 * 2 = 192 KB of shared memory.
_SHAPES = {
    (128, "w32"): _Shape(threads=128, block_n=32, stages=3),
    (128, "w16"): _Shape(threads=256, block_n=64, stages=3),
    (64, "w32"): _Shape(threads=128, block_n=64, stages=3),
    (64, "w16"): _Shape(threads=256, block_n=64, stages=3),
    (256, "w16"): _Shape(threads=256, block_n=64, stages=2),
}


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a flat batch of new tokens over the paged cache.

    q: bf16 [T, Hq, D], D 64, 128 or 256; k_cache, v_cache: bf16 [P, S, Hkv, D], S
    a power of two (token t of sequence b at page block_tables[b, t // S],
    offset t % S), Hq a multiple of Hkv (query head h reads kv head
    h // (Hq / Hkv));
    query_start_loc: int32 [B + 1] (sequence b owns q rows
    query_start_loc[b]:query_start_loc[b + 1], possibly none); seq_lens: int32
    [B], tokens cached for b after this step, the K/V of its new tokens
    already written; block_tables: int32 [B, max_pages]; max_query_len: a host
    int no smaller than any sequence's q_len (it sizes the grid: nothing is
    read back from the device). Returns (or fills) bf16 [T, Hq, D].
    The caches may both be float8_e4m3fn (an fp8 cache): tiles are widened
    to bf16 (values times k_scale, v_scale) on their way into shared memory.
    """
    return _prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                              scale, max_query_len, out, variant=None, k_scale=k_scale,
                              v_scale=v_scale)


def _prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None,
    variant: str | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """paged_prefill_attention with the kernel shape ("w32" or "w16") forced
    when variant is given (tests cover both), else picked by grid size (and
    head dim: 256 has w16 only)."""
    check_cuda_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    device = q.device
    fp8 = check_kv_caches(k_cache, v_cache, device)
    scales = reader_scales(fp8, k_scale, v_scale)
    check_cuda_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1,
                      device=device)
    check_cuda_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=device)
    check_cuda_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2, device=device)
    tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"head dim must be one of {_HEAD_DIMS}, got {head_dim}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head dim {cache_head_dim} differs from q's {head_dim}")
    if num_kv_heads == 0 or num_q_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a positive multiple of kv heads "
            f"({num_kv_heads})"
        )
    if num_pages == 0:
        raise ValueError(f"the cache has no pages: shape {tuple(k_cache.shape)}")
    # The kernel finds a token's page with a shift; the engine's page sizes
    # are powers of two.
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page size must be a power of two, got {page_size}")
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc must have B + 1 = {batch + 1} entries, got "
            f"{query_start_loc.shape[0]}"
        )
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have B = {batch} rows, got {block_tables.shape[0]}")
    if batch > _MAX_GRID_Y:
        raise ValueError(f"at most {_MAX_GRID_Y} sequences a call, got {batch}")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, (int, np.integer)):
        raise ValueError(f"max_query_len must be a host int, got {type(max_query_len).__name__}")
    max_query_len = int(max_query_len)
    if max_query_len < 0 or max_query_len > tokens:
        raise ValueError(f"max_query_len must be in [0, T = {tokens}], got {max_query_len}")
    if tokens > 0 and (batch == 0 or max_query_len == 0):
        raise ValueError(
            f"{tokens} query rows but B = {batch} and max_query_len = {max_query_len}"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise ValueError(f"scale must be a float, got {type(scale).__name__}")
    scale = float(scale)
    # The kernel's online softmax folds the scale into exp2's argument after
    # the row max, which is only right for a positive scale.
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be finite and positive, got {scale}")
    if block_tables.shape[1] * page_size > _INT32_MAX or num_pages > _INT32_MAX:
        raise ValueError("the cache is too large for 32-bit token positions and page ids")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=3, device=device)
        if out.shape != q.shape:
            raise ValueError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    # Rows move as 16-byte vectors (cp.async in, uint4 out): a contiguous view
    # that starts mid-vector would fault.
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if tensor.data_ptr() % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary")
    if tokens == 0:
        return out

    group = num_q_heads // num_kv_heads
    packed_rows = max_query_len * group  # (token, query head) rows of the longest sequence
    if packed_rows > _INT32_MAX - _BLOCK_M:
        raise ValueError(f"max_query_len * Hq / Hkv = {packed_rows} is too large")
    row_tiles = -(-packed_rows // _BLOCK_M)
    grid_x = row_tiles * num_kv_heads
    if grid_x > _INT32_MAX:
        raise ValueError(f"grid of {grid_x} blocks is too large")
    device_index = device.index if device.index is not None else torch.cuda.current_device()
    if variant is None:
        # w32 runs two blocks an SM; below two blocks an SM of work, w16's
        # twice-as-many warps a row tile keep the SMs busier.
        big_grid = grid_x * batch >= 2 * _multiprocessors(device_index)
        variant = "w32" if big_grid and (head_dim, "w32") in _SHAPES else "w16"
    shape = _SHAPES.get((head_dim, variant))
    if shape is None:
        raise ValueError(f"no {variant!r} prefill kernel for head dim {head_dim}")

    suffix = "_fp8" if fp8 else ""
    kernel = load_kernel(_SOURCE, f"paged_prefill_attention_d{head_dim}_{variant}{suffix}",
                         device_index)
    shared = shape.shared_bytes(head_dim)
    set_max_dynamic_shared(kernel, shared)
    launch(
        kernel,
        (grid_x, batch),
        (shape.threads,),
        (
            ptr(out), ptr(q), ptr(k_cache), ptr(v_cache),
            ptr(query_start_loc), ptr(seq_lens), ptr(block_tables),
            np.int32(num_q_heads), np.int32(num_kv_heads), np.int32(num_pages),
            np.int32(page_size.bit_length() - 1), np.int32(block_tables.shape[1]),
            np.float32(scale * math.log2(math.e)), *scales,
        ),
        device,
        shared_bytes=shared,
    )
    return out
