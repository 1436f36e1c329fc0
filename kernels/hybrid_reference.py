"""Torch references of the norms and RoPE of Qwen3-Next's and Qwen3.5's layers.

Pure torch, any device and dtype: the CPU path of the hybrid models
(engine/models/hybrid_layers.py) and what the CUDA kernels (kernels/norm.py's
zero_centred variants, kernels/gated_norm.py, kernels/gated_rope_cache.py)
are compared with. The rounding follows transformers' Qwen3-Next modules op
by op, so the CPU path stays exact against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + weight), all in float32 and rounded once, as
    Qwen3-Next and Qwen3.5 compute it (checkpoints store weights near 0)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def add_zero_centred_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(zero_centred_rms_norm(x + residual), x + residual): transformers'
    Qwen3-Next layer adds the residual in the activation dtype, then norms."""
    summed = x + residual
    return zero_centred_rms_norm(summed, weight, eps), summed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The Gated DeltaNet output norm: RMSNorm over the last dim (plain
    weight, rounded to x's dtype before scaling), then times silu(gate) in float32."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def apply_partial_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first rotary_dim dims of each head (rope_cache is built
    for rotary_dim: [max_positions, rotary_dim]); the rest pass through."""
    rotary_dim = rope_cache.shape[-1]
    if rotary_dim == q.shape[-1]:
        return reference.apply_rope(positions, q, k, rope_cache)
    q_rot, k_rot = reference.apply_rope(positions, q[..., :rotary_dim], k[..., :rotary_dim],
                                        rope_cache)
    return (torch.cat((q_rot, q[..., rotary_dim:]), dim=-1),
            torch.cat((k_rot, k[..., rotary_dim:]), dim=-1))


def split_gated_qkv(projected: torch.Tensor, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> tuple[torch.Tensor, ...]:
    """GatedAttention's projection [T, 2 Hq D + 2 Hkv D] (per q head D of q,
    then D of gate; then k, then v) -> views q [T, Hq, D], gate [T, Hq, D],
    k [T, Hkv, D], v [T, Hkv, D]."""
    tokens = projected.shape[0]
    q_and_gate, k, v = projected.split(
        [2 * num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, gate = q_and_gate.view(tokens, num_heads, 2 * head_dim).chunk(2, dim=-1)
    return (q, gate, k.view(tokens, num_kv_heads, head_dim),
            v.reshape(tokens, num_kv_heads, head_dim))


def gated_qk_norm_rope(
    projected: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor,
    q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, num_heads: int,
    num_kv_heads: int, head_dim: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GatedAttention before the attention proper: zero-centred q/k norms per
    head, then partial RoPE. Returns (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])."""
    q, _, k, v = split_gated_qkv(projected, num_heads, num_kv_heads, head_dim)
    q = zero_centred_rms_norm(q, q_norm_weight, eps)
    k = zero_centred_rms_norm(k, k_norm_weight, eps)
    q, k = apply_partial_rope(positions, q, k, rope_cache)
    return q, k, v
