"""Paged decode attention on the GPU (one query token per sequence, GQA, split-K).

Reference: kernels.reference.paged_attention with q_len = 1 for every row.
The kernel source (kernels/csrc/decode_attention.cu) explains the tiling; in
short, a CTA of 4 warps owns one (batch row, kv head, split) and reads each of
its K/V rows once for all the query heads of the GQA group, on tensor cores.
At head dim 256 a CTA holds at most 8 query heads, so a group of 9-16 takes
two CTAs per (row, kv head, split), each reading the split's K/V.

Split-K: the context is cut into chunks of 64 tokens dealt round-robin to
`num_splits` CTAs per (row, kv head). The split count is a function of the
batch size, the kv head count and max_seq_len only (so a CUDA graph captured
for a batch size replays for any lengths): enough CTAs to fill the GPU several
times over, with no split shorter than 256 tokens of max_seq_len unless even
the finest split cannot fill one wave. Splits whose first chunk lies past a
row's seq_len exit at once; a second kernel merges the others (log-sum-exp).
With a single split the first kernel writes `out` itself.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor, launch, load_kernel, ptr
from kernels.kv_cache_dtype import check_kv_caches, reader_scales

_SOURCE = "decode_attention.cu"
_THREADS = 128
_CHUNK_TOKENS = 64  # kChunkTokens in the .cu: tokens one CTA covers per step
# A split covers at least this many tokens of max_seq_len when the grid is
# full anyway: each split costs a float32 partial of its group's heads (write
# plus read: 2 * group / tokens of the K/V bytes), so short splits only pay off
# when the GPU would otherwise sit idle.
_MIN_SPLIT_TOKENS = 256
# CTAs of the D = 128, group <= 8 kernel resident on one multiprocessor (154
# registers a thread: 3 x 128 x 154 of the 64 K registers). D = 256 takes 255
# registers (2 CTAs); the split rule keeps 3 for every head dim (a tuning
# number, not a limit).
_RESIDENT_CTAS_PER_SM = 3
# CTAs to aim for, in waves of the GPU: enough that the last, partial wave of
# equal-length rows costs little. Tunable.
_TARGET_WAVES = 8
_TARGET_CTAS_PER_SM = _RESIDENT_CTAS_PER_SM * _TARGET_WAVES
_MAX_GRID_YZ = 65535
_HEAD_DIMS = (64, 128, 256)
_MAX_GROUP = 16
# Query heads one D = 256 CTA holds (a larger group takes two CTAs a split).
_D256_HEADS_PER_CTA = 8
_LOG2E = math.log2(math.e)


@dataclass(frozen=True, eq=False)
class DecodeWorkspace:
    """Preallocated split-K partials for paged_decode_attention.

    partial_out: float32 [rows, head_dim], the unnormalized output of each
    (batch row, query head, split); partial_stats: float32 [rows, 2], its
    running max (log2 domain) and sum of exp2. A call with batch B, Hq heads
    and n splits uses rows [0, B * Hq * n), ordered (row, head, split).
    """

    max_batch: int
    num_heads: int
    head_dim: int
    max_seq_len: int
    partial_out: torch.Tensor
    partial_stats: torch.Tensor

    @property
    def capacity(self) -> int:
        """Partial rows available."""
        return self.partial_stats.shape[0]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Splits per (row, kv head): a function of host ints only (graph-safe grid)."""
    rows = batch * num_kv_heads
    wanted = -(-sm_count * _TARGET_CTAS_PER_SM // rows)
    coarse = -(-max_seq_len // _MIN_SPLIT_TOKENS)
    fine = -(-max_seq_len // _CHUNK_TOKENS)
    # Small batches: 256-token splits cannot fill one wave, so go down to
    # one chunk per split (a short row under a large max_seq_len then still
    # spreads over many CTAs, because chunks are dealt round-robin).
    limit = coarse if rows * coarse >= sm_count * _RESIDENT_CTAS_PER_SM else fine
    return max(1, min(wanted, limit))


def _max_splits(batch: int, max_seq_len: int, sm_count: int) -> int:
    """An upper bound of _num_splits(batch, h, m, sm_count) over every kv head
    count h >= 1 and m <= max_seq_len (the choice of limit there is not
    monotonic in m, so the workspace is sized from this instead)."""
    wanted = -(-sm_count * _TARGET_CTAS_PER_SM // batch)
    return max(1, min(wanted, -(-max_seq_len // _CHUNK_TOKENS)))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def decode_workspace(
    max_batch: int, num_heads: int, head_dim: int, max_seq_len: int, device: torch.device
) -> DecodeWorkspace:
    """Workspace for batches of up to max_batch rows of num_heads query heads of
    head_dim, with max_seq_len up to max_seq_len, on CUDA device."""
    for name, value in (("max_batch", max_batch), ("num_heads", num_heads),
                        ("max_seq_len", max_seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {_HEAD_DIMS}, got {head_dim}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the decode workspace must be on a CUDA device, got {device}")
    sms = _sm_count(_device_index(device))
    # The most rows any batch size up to max_batch can use. Past
    # _TARGET_CTAS_PER_SM * sms rows a batch has one split, so the loop stops there.
    last = min(max_batch, sms * _TARGET_CTAS_PER_SM)
    per_head = max(max_batch, *(b * _max_splits(b, max_seq_len, sms) for b in range(1, last + 1)))
    rows = per_head * num_heads
    return DecodeWorkspace(
        max_batch=max_batch,
        num_heads=num_heads,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        partial_out=torch.empty((rows, head_dim), dtype=torch.float32, device=device),
        partial_stats=torch.empty((rows, 2), dtype=torch.float32, device=device),
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    workspace: DecodeWorkspace | None,
    out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV cache.

    q: bf16 [B, Hq, D], D in (64, 128, 256); k_cache, v_cache: bf16 [P, S, Hkv, D]
    with S a power of two and Hq = group * Hkv, group <= 16 (query head h
    reads kv head h // group); block_tables: int32 [>= B, max_pages] (token t
    of row b is in page block_tables[b, t // S], slot t % S); seq_lens: int32
    [>= B], each in 1..max_seq_len (the caller's promise: never read here).
    Only the first B rows of block_tables and seq_lens are used. Returns (or
    fills) bf16 [B, Hq, D]. Allocates nothing when out is given and launches a
    grid fixed by B, Hkv and max_seq_len, so it can be captured in a CUDA graph.
    The caches may both be float8_e4m3fn (an fp8 cache): K and V are read as
    their values times k_scale and v_scale, rounded to bf16 (exact for a
    power-of-two scale), then as from a bf16 cache.
    num_splits: the splits per (row, kv head) instead of the split rule's
    choice (which depends on B and max_seq_len). 1 (--deterministic) makes
    a row's result depend on its own q, length and K/V alone: one CTA walks
    its context in a fixed order and writes out itself; the workspace is
    then unused (None allowed) and B, max_seq_len are not bound by it.
    """
    check_cuda_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    device = q.device
    fp8 = check_kv_caches(k_cache, v_cache, device)
    scales = reader_scales(fp8, k_scale, v_scale)
    check_cuda_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2, device=device)
    check_cuda_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=device)
    batch, num_heads, head_dim = q.shape
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"head dim must be one of {_HEAD_DIMS}, got {head_dim}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}"
        )
    _, page_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"cache head dim {cache_dim} != q head dim {head_dim}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page size must be a power of two, got {page_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        # Rows are read with 16-byte loads; a view at an odd offset would fault.
        if tensor.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address")
    group = num_heads // num_kv_heads
    if group > _MAX_GROUP:
        raise ValueError(f"at most {_MAX_GROUP} query heads per kv head, got {group}")
    if block_tables.shape[0] < batch or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables must have >= {batch} rows and >= 1 column, got "
            f"{tuple(block_tables.shape)}"
        )
    if seq_lens.shape[0] < batch:
        raise ValueError(f"seq_lens must have >= {batch} entries, got {seq_lens.shape[0]}")
    if batch > _MAX_GRID_YZ or num_kv_heads > _MAX_GRID_YZ:
        raise ValueError(f"batch and kv heads must be <= {_MAX_GRID_YZ}, got {batch}, {num_kv_heads}")
    # A tensor scale would need a device read (a sync): only host numbers.
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python number, got {scale!r}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if num_splits != 1:
        _check_workspace(workspace, batch, num_heads, head_dim, max_seq_len, device)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=3, device=device)
        if out.shape != q.shape:
            raise ValueError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if batch == 0:
        return out

    index = _device_index(device)
    # CTAs sharing one (row, kv head, split): the kernel name's group tile and
    # decode_split's HT in the .cu.
    head_tiles = 2 if head_dim == 256 and group > _D256_HEADS_PER_CTA else 1
    # Counted as kv heads: the split rule aims at a number of CTAs.
    splits = num_splits or _num_splits(batch, num_kv_heads * head_tiles, max_seq_len,
                                       _sm_count(index))
    if splits > 1 and batch * num_heads * splits > workspace.capacity:  # type: ignore[union-attr]
        # Cannot happen for a workspace made by decode_workspace on this device.
        raise ValueError(
            f"workspace holds {workspace.capacity} partials, this call needs "
            f"{batch * num_heads * splits}"
        )
    name = f"paged_decode_d{head_dim}_g{8 if group <= 8 else 16}{'_fp8' if fp8 else ''}"
    kernel = load_kernel(_SOURCE, name, index)
    # One split writes out itself: the partials' pointers are never read.
    partial_out, partial_stats = ((ptr(workspace.partial_out), ptr(workspace.partial_stats))
                                  if workspace is not None else (np.uint64(0), np.uint64(0)))
    launch(
        kernel,
        (splits * head_tiles, num_kv_heads, batch),
        (_THREADS,),
        (
            ptr(out), partial_out, partial_stats, ptr(q),
            ptr(k_cache), ptr(v_cache), ptr(block_tables), ptr(seq_lens),
            np.float32(scale * _LOG2E), np.int32(num_kv_heads), np.int32(group),
            np.int32(page_size.bit_length() - 1), np.int32(block_tables.shape[1]),
            np.int32(splits), *scales,
        ),
        device,
    )
    if splits > 1:
        reduce = load_kernel(_SOURCE, "paged_decode_reduce", index)
        launch(
            reduce,
            (num_heads, batch),
            (min(head_dim, _THREADS),),  # the .cu's launch bound; threads stride over D
            (
                ptr(out), partial_out, partial_stats,
                ptr(seq_lens), np.int32(num_heads), np.int32(head_dim), np.int32(splits),
            ),
            device,
        )
    return out


def _check_workspace(workspace: DecodeWorkspace | None, batch: int, num_heads: int,
                     head_dim: int, max_seq_len: int, device: torch.device) -> None:
    if not isinstance(workspace, DecodeWorkspace):
        raise ValueError(f"workspace must be a DecodeWorkspace, got {type(workspace).__name__}")
    if batch > workspace.max_batch:
        raise ValueError(f"batch {batch} exceeds the workspace's max_batch {workspace.max_batch}")
    if max_seq_len > workspace.max_seq_len:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the workspace's {workspace.max_seq_len}"
        )
    if num_heads > workspace.num_heads or head_dim != workspace.head_dim:
        raise ValueError(
            f"workspace is for {workspace.num_heads} heads of dim {workspace.head_dim}, "
            f"got {num_heads} heads of dim {head_dim}"
        )
    if workspace.partial_out.device != device:
        raise ValueError(f"workspace is on {workspace.partial_out.device}, expected {device}")
