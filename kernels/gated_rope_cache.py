"""GatedAttention's q/k norms, partial RoPE and KV-cache write in one launch,
and its output gate in another (Qwen3-Next, Qwen3.5).

gated_rope_and_cache reads the q_proj | k_proj | v_proj output as it comes
(q and gate interleaved per head) and does what the reference
kernels.hybrid_reference.gated_qk_norm_rope + write_kv_cache do with about
twenty torch ops and three copies: zero-centred RMSNorm of every q and k
head, RoPE on its first rotary_dim dims, k and v into the paged cache, q out.
sigmoid_gate_mul is the layer's out * sigmoid(gate), the gate read from the
projection in place. Same rounding steps as torch's ops; only the norm's
variance is summed in another order, so an element can rarely differ.

CUDA-graph safe: with the outputs given nothing is allocated, nothing syncs,
and the grids depend only on the shapes. As kernels/rope_cache.py: a
slot_mapping entry < 0 or past the cache's end is not written, and a
position outside the cos/sin table gives NaN in the rotated dims.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor, launch, load_kernel, ptr, tensors_overlap
from kernels.kv_cache_dtype import check_kv_caches, writer_scales

_SOURCE = "gated_rope_cache.cu"
_HEAD_DIMS = (64, 128, 256)
_THREADS = 128


def rotary_dim_supported(head_dim: int, rotary_dim: int) -> bool:
    """The kernel rotates all of a head, or a first part of at most half of
    it whose length / 16 is a power of two (Qwen3.5's 64 of 256)."""
    if head_dim not in _HEAD_DIMS:
        return False
    if rotary_dim == head_dim:
        return True
    pairs = rotary_dim // 16
    return (rotary_dim % 16 == 0 and 0 < rotary_dim <= head_dim // 2
            and pairs & (pairs - 1) == 0)


def _check_aligned(name: str, tensor: torch.Tensor) -> None:
    if tensor.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address")


def _check_norm_weight(name: str, weight: torch.Tensor, head_dim: int,
                       device: torch.device) -> None:
    check_cuda_tensor(name, weight, dtype=torch.bfloat16, ndim=1, device=device)
    if weight.shape[0] != head_dim:
        raise ValueError(f"{name} must be [{head_dim}], got {tuple(weight.shape)}")
    _check_aligned(name, weight)


def gated_rope_and_cache(
    projected: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    q_out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Norm and rotate q and k of GatedAttention's projection, cache k and v, return q.

    projected: bf16 [T, 2 Hq D + 2 Hkv D]: per token, for each q head D of q
    then D of its gate, then the Hkv k heads, then the Hkv v heads;
    positions: int64 [T]; cos_sin_cache: bf16 [max_positions, R] from
    build_rope_cache(R, ...), R the rotary dims (rotary_dim_supported);
    k_cache, v_cache: bf16 [P, S, Hkv, D]; slot_mapping: int64 [T] (< 0: not
    written); q_norm_weight, k_norm_weight: bf16 [D], zero-centred (scale 1 + w).
    D is 64, 128 or 256 and Hq a multiple of Hkv.

    Writes rope(zc_norm(k)) and v to the caches' rows k_cache.view(-1, Hkv, D)
    [slot] and returns (or fills) q_out, bf16 [T, Hq, D] = rope(zc_norm(q)).
    float8_e4m3fn caches (an fp8 cache) get e4m3(x / k_scale) and e4m3(x /
    v_scale), as kernels/rope_cache.py writes them.
    """
    check_cuda_tensor("projected", projected, dtype=torch.bfloat16, ndim=2)
    device = projected.device
    fp8 = check_kv_caches(k_cache, v_cache, device)
    scales = writer_scales(fp8, k_scale, v_scale)
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    pages, page_size, cache_kv_heads, head_dim = k_cache.shape
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"head size (k_cache's last dim) must be one of {_HEAD_DIMS}, "
                         f"got {head_dim}")
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if cache_kv_heads != num_kv_heads:
        raise ValueError(f"k_cache has {cache_kv_heads} kv heads, expected {num_kv_heads}")
    tokens, width = projected.shape
    if width != 2 * (num_heads + num_kv_heads) * head_dim:
        raise ValueError(f"projected must be [T, 2 (Hq + Hkv) D] = "
                         f"[T, {2 * (num_heads + num_kv_heads) * head_dim}], "
                         f"got {tuple(projected.shape)}")
    heads_per_token = num_heads + 2 * num_kv_heads
    if tokens * heads_per_token * (head_dim // 16) >= 2**31:
        raise ValueError(f"too many tokens ({tokens}) for one launch")
    check_cuda_tensor("positions", positions, dtype=torch.int64, ndim=1, device=device)
    check_cuda_tensor("slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, device=device)
    if positions.shape[0] != tokens or slot_mapping.shape[0] != tokens:
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} must both be [{tokens}]")
    check_cuda_tensor("cos_sin_cache", cos_sin_cache, dtype=torch.bfloat16, ndim=2,
                      device=device)
    max_positions, rotary_dim = cos_sin_cache.shape
    if not rotary_dim_supported(head_dim, rotary_dim) or not 0 < max_positions < 2**31:
        raise ValueError(f"cos_sin_cache must be [max_positions, R], R = {head_dim} or a "
                         f"power-of-two multiple of 16 up to {head_dim // 2}, "
                         f"got {tuple(cos_sin_cache.shape)}")
    _check_norm_weight("q_norm_weight", q_norm_weight, head_dim, device)
    _check_norm_weight("k_norm_weight", k_norm_weight, head_dim, device)
    if q_out is None:
        q_out = torch.empty((tokens, num_heads, head_dim), dtype=projected.dtype, device=device)
    else:
        check_cuda_tensor("q_out", q_out, dtype=torch.bfloat16, ndim=3, device=device)
        if q_out.shape != (tokens, num_heads, head_dim):
            raise ValueError(
                f"q_out must be {(tokens, num_heads, head_dim)}, got {tuple(q_out.shape)}")
    for name, tensor in (("projected", projected), ("cos_sin_cache", cos_sin_cache),
                         ("k_cache", k_cache), ("v_cache", v_cache), ("q_out", q_out)):
        _check_aligned(name, tensor)
    if tokens == 0:
        return q_out
    for name, written in (("q_out", q_out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensors_overlap(written, projected):
            raise ValueError(f"{name} must not overlap projected")
    if tensors_overlap(k_cache, v_cache) or tensors_overlap(q_out, k_cache) or tensors_overlap(q_out, v_cache):
        raise ValueError("q_out, k_cache and v_cache must not overlap")

    kernel = load_kernel(_SOURCE, f"gated_rope_and_cache_d{head_dim}{'_fp8' if fp8 else ''}",
                         device.index or 0)
    threads = tokens * heads_per_token * (head_dim // 16)
    grid = -(-threads // _THREADS)
    args = (ptr(q_out), ptr(k_cache), ptr(v_cache), ptr(projected), ptr(positions),
            ptr(cos_sin_cache), ptr(slot_mapping), ptr(q_norm_weight), ptr(k_norm_weight),
            np.int32(tokens), np.int32(num_heads), np.int32(num_kv_heads), np.int32(rotary_dim),
            np.int32(max_positions), np.int64(pages * page_size), np.float32(eps), *scales)
    launch(kernel, (grid,), (_THREADS,), args, device)
    return q_out


def sigmoid_gate_mul(attn: torch.Tensor, projected: torch.Tensor, num_heads: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """attn: bf16 [T, Hq * D] (the attention output); projected: the bf16
    [T, 2 Hq D + 2 Hkv D] projection whose gates (head h's D values at
    h * 2D + D) scale it. Returns (or fills) out = attn * sigmoid(gate),
    rounded as torch's bf16 ops; out may be attn itself."""
    check_cuda_tensor("attn", attn, dtype=torch.bfloat16, ndim=2)
    check_cuda_tensor("projected", projected, dtype=torch.bfloat16, ndim=2, device=attn.device)
    tokens, q_size = attn.shape
    if num_heads <= 0 or q_size % num_heads or (q_size // num_heads) % 8:
        raise ValueError(f"attn's width {q_size} must be num_heads ({num_heads}) heads of a "
                         "multiple of 8")
    head_dim = q_size // num_heads
    if projected.shape[0] != tokens or projected.shape[1] < 2 * q_size:
        raise ValueError(f"projected must be [{tokens}, >= {2 * q_size}], "
                         f"got {tuple(projected.shape)}")
    if projected.shape[1] % 8:
        raise ValueError("projected's rows must be a multiple of 8 wide (16-byte loads)")
    if out is None:
        out = torch.empty_like(attn)
    else:
        check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=2, device=attn.device)
        if out.shape != attn.shape:
            raise ValueError(f"out must be {tuple(attn.shape)}, got {tuple(out.shape)}")
    for name, tensor in (("attn", attn), ("projected", projected), ("out", out)):
        _check_aligned(name, tensor)
    if tokens == 0:
        return out
    if tensors_overlap(out, projected):
        raise ValueError("out must not overlap projected")
    if out.data_ptr() != attn.data_ptr() and tensors_overlap(out, attn):
        raise ValueError("out must be attn itself or not overlap it")
    grid = -(-(tokens * q_size // 8) // _THREADS)
    if grid >= 2**31:
        raise ValueError(f"too many tokens ({tokens}) for one launch")
    kernel = load_kernel(_SOURCE, "sigmoid_gate_mul", attn.device.index or 0)
    args = (ptr(out), ptr(attn), ptr(projected), np.int32(tokens), np.int32(num_heads),
            np.int32(head_dim), np.int64(projected.shape[1]))
    launch(kernel, (grid,), (_THREADS,), args, attn.device)
    return out
