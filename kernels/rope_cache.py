"""Rotary embedding fused with the paged KV-cache write (and Qwen3's q/k norms).

References: kernels.reference.rms_norm (per head, over D), apply_rope and
write_kv_cache. The rotation rounds as torch's bf16 ops do, so without q/k
norm the results are bitwise equal to the reference; with it, an element can
rarely differ where the norm's variance (summed in another order) does.

CUDA-graph safe: with `q_out` given nothing is allocated, nothing syncs, and
the launch grid depends only on the shapes. Tensor contents are not checked
(that would sync): a slot_mapping entry < 0 means "do not cache this token"
(padding rows of a graph batch), a slot past the cache's end is skipped the
same way, and a position outside the cos/sin table gives NaN rows.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor, launch, load_kernel, ptr, tensors_overlap
from kernels.kv_cache_dtype import check_kv_caches, writer_scales

_SOURCE = "rope_cache.cu"
_HEAD_DIMS = (64, 128, 256)
_THREADS = 128


def _check_aligned(name: str, tensor: torch.Tensor) -> None:
    # 16-byte vector accesses: a view starting mid-vector would fault.
    if tensor.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address")


def _check_norm_weight(name: str, weight: torch.Tensor | None, head_dim: int,
                       device: torch.device) -> np.uint64:
    """The weight's address as a kernel argument, 0 for None (no norm)."""
    if weight is None:
        return np.uint64(0)
    check_cuda_tensor(name, weight, dtype=torch.bfloat16, ndim=1, device=device)
    if weight.shape[0] != head_dim:
        raise ValueError(f"{name} must be [{head_dim}], got {tuple(weight.shape)}")
    _check_aligned(name, weight)
    return ptr(weight)


def rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    q_out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate q and k of the fused projection, cache k and v, return q.

    qkv: bf16 [T, (Hq + 2 Hkv) * D], per token the Hq q heads, then the Hkv k
    heads, then the Hkv v heads, D values each; positions: int64 [T];
    cos_sin_cache: bf16 [max_positions, D] from build_rope_cache; k_cache,
    v_cache: bf16 [P, S, Hkv, D]; slot_mapping: int64 [T] (slot = page * S +
    offset, < 0: not written); q_norm_weight, k_norm_weight: bf16 [D] or None
    (RMSNorm of each head over D with eps, before the rotation). D is 64, 128
    or 256 and Hq a multiple of Hkv.

    Writes rope(norm(k)) and v to the caches' rows k_cache.view(-1, Hkv, D)
    [slot] and returns (or fills) q_out, bf16 [T, Hq, D] = rope(norm(q)).
    The caches may instead both be float8_e4m3fn (an fp8 cache): the rows
    then hold e4m3(x / k_scale) and e4m3(x / v_scale), x the bf16 values,
    saturated at +-448 (kernels.reference.quantize_fp8).
    """
    check_cuda_tensor("qkv", qkv, dtype=torch.bfloat16, ndim=2)
    device = qkv.device
    fp8 = check_kv_caches(k_cache, v_cache, device)
    scales = writer_scales(fp8, k_scale, v_scale)
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}"
        )
    pages, page_size, cache_kv_heads, head_dim = k_cache.shape
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"head size (k_cache's last dim) must be one of {_HEAD_DIMS}, got {head_dim}")
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    if cache_kv_heads != num_kv_heads:
        raise ValueError(f"k_cache has {cache_kv_heads} kv heads, expected {num_kv_heads}")
    tokens, width = qkv.shape
    heads_per_token = num_heads + 2 * num_kv_heads
    if width != heads_per_token * head_dim:
        raise ValueError(
            f"qkv must be [T, (Hq + 2 * Hkv) * D] = [T, {heads_per_token * head_dim}], got {tuple(qkv.shape)}"
        )
    # The kernel indexes threads with int32.
    if tokens * heads_per_token * (head_dim // 16) >= 2**31:
        raise ValueError(f"too many tokens ({tokens}) for one launch")
    check_cuda_tensor("positions", positions, dtype=torch.int64, ndim=1, device=device)
    check_cuda_tensor("slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, device=device)
    if positions.shape[0] != tokens or slot_mapping.shape[0] != tokens:
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
            f"must both be [{tokens}]"
        )
    check_cuda_tensor("cos_sin_cache", cos_sin_cache, dtype=torch.bfloat16, ndim=2, device=device)
    max_positions = cos_sin_cache.shape[0]
    if cos_sin_cache.shape[1] != head_dim or not 0 < max_positions < 2**31:
        raise ValueError(f"cos_sin_cache must be [max_positions, {head_dim}], got "
                         f"{tuple(cos_sin_cache.shape)}")
    q_norm = _check_norm_weight("q_norm_weight", q_norm_weight, head_dim, device)
    k_norm = _check_norm_weight("k_norm_weight", k_norm_weight, head_dim, device)
    if q_out is None:
        q_out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=device)
    else:
        check_cuda_tensor("q_out", q_out, dtype=torch.bfloat16, ndim=3, device=device)
        if q_out.shape != (tokens, num_heads, head_dim):
            raise ValueError(
                f"q_out must be {(tokens, num_heads, head_dim)}, got {tuple(q_out.shape)}"
            )
    for name, tensor in (("qkv", qkv), ("cos_sin_cache", cos_sin_cache), ("k_cache", k_cache),
                         ("v_cache", v_cache), ("q_out", q_out)):
        _check_aligned(name, tensor)
    if tokens == 0:
        return q_out
    # Threads read qkv while others write q_out and the caches.
    for name, written in (("q_out", q_out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensors_overlap(written, qkv):
            raise ValueError(f"{name} must not overlap qkv")
    if tensors_overlap(k_cache, v_cache) or tensors_overlap(q_out, k_cache) or tensors_overlap(q_out, v_cache):
        raise ValueError("q_out, k_cache and v_cache must not overlap")

    kernel = load_kernel(_SOURCE, f"rope_and_cache_d{head_dim}{'_fp8' if fp8 else ''}",
                         device.index or 0)
    threads = tokens * heads_per_token * (head_dim // 16)
    grid = -(-threads // _THREADS)
    args = (ptr(q_out), ptr(k_cache), ptr(v_cache), ptr(qkv), ptr(positions), ptr(cos_sin_cache),
            ptr(slot_mapping), q_norm, k_norm, np.int32(tokens), np.int32(num_heads),
            np.int32(num_kv_heads), np.int32(max_positions), np.int64(pages * page_size),
            np.float32(eps), *scales)
    launch(kernel, (grid,), (_THREADS,), args, device)
    return q_out
