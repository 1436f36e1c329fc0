"""The pieces Qwen3-Next and Qwen3.5 add to the decoder, on the CPU reference path.

- Zero-centred RMSNorms: their weights w scale by (1 + w), in float32
  (ops.zero_centred_rms_norm; references in kernels/hybrid_reference.py).
- GatedAttention: full attention whose q_proj emits, per head, q and a gate;
  the attention output is multiplied by sigmoid(gate) before o_proj. q/k get a
  zero-centred RMSNorm per head and RoPE turns only the first rotary_dim dims
  (all of it between the projections is ops.gated_attention: one fused
  kernel for norms, RoPE and cache write on the GPU).
- GatedDeltaNet: the linear-attention token mixer over per-sequence state
  slots (kernels/gated_delta_reference.py), with its gated RMSNorm.
- SharedExpertMoE: Qwen3-Next's (and Qwen2-MoE's) routed experts (a
  SparseMoE, stacks as usual) plus one always-on shared expert scaled by a
  sigmoid gate.

Checkpoints keep the projections in their own row layouts (Qwen3-Next groups
in_proj_qkvz per key head, q_proj interleaves q and gate per head). A fused
weight's slots are row slices, and a per-head interleave is no row slice, so
the weights keep the checkpoint's row order and the ops de-interleave the
projection's output (the reference with views and one concatenation, the
kernels by reading it in place).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.model_ops import ReferenceOps
from engine.models.config import ModelConfig
from engine.models.weight_alloc import empty_weight

# A linear-attention layer's entry in kv_caches: (conv_states [S, C, K-1],
# states [S, Hv, Dk, Dv]); a full-attention layer's is (k_cache, v_cache).
StatePools = tuple[torch.Tensor, torch.Tensor]


def _weight(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    return empty_weight(shape, device, dtype)


class GatedAttention(nn.Module):
    """Full attention with an output gate, over the paged KV cache."""

    # Multiplied by through ops.linear: a GGUF load may keep them packed.
    linear_weights: ClassVar[tuple[str, ...]] = ("qkv_weight", "o_weight")

    def __init__(self, config: ModelConfig, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        # Rows: q_proj as stored (per head: D of q, then D of gate), k_proj, v_proj.
        rows = 2 * config.q_size + 2 * config.kv_size
        self.qkv_weight = _weight(rows, config.hidden_size, **kw)
        self.qkv_bias = _weight(rows, **kw) if config.attention_bias else None
        self.o_weight = _weight(config.hidden_size, config.q_size, **kw)
        self.o_bias = _weight(config.hidden_size, **kw) if config.o_proj_bias else None
        self.q_norm_weight = _weight(config.head_dim, **kw)
        self.k_norm_weight = _weight(config.head_dim, **kw)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: StatePools, rope_cache: torch.Tensor,
                ops: ReferenceOps) -> torch.Tensor:
        projected = ops.linear(hidden, self.qkv_weight, self.qkv_bias)
        # The zero-centred q/k norms, partial RoPE and output gate are this
        # layer's own: ops.gated_attention (a fused kernel on the GPU).
        out = ops.gated_attention(self.config, projected, positions, meta, kv_cache, rope_cache,
                                  self.q_norm_weight, self.k_norm_weight)
        return ops.linear(out, self.o_weight, self.o_bias)

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        q2, kv = 2 * self.config.q_size, self.config.kv_size
        slices = {"q_proj": slice(0, q2), "k_proj": slice(q2, q2 + kv),
                  "v_proj": slice(q2 + kv, q2 + 2 * kv)}
        dests = {f"{prefix}.{name}.weight": self.qkv_weight[rows] for name, rows in slices.items()}
        if self.qkv_bias is not None:
            dests.update({f"{prefix}.{name}.bias": self.qkv_bias[rows]
                          for name, rows in slices.items()})
        dests[f"{prefix}.o_proj.weight"] = self.o_weight
        if self.o_bias is not None:
            dests[f"{prefix}.o_proj.bias"] = self.o_bias
        dests[f"{prefix}.q_norm.weight"] = self.q_norm_weight
        dests[f"{prefix}.k_norm.weight"] = self.k_norm_weight
        return dests


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer: projections, causal conv, gated delta
    rule over the sequences' state slots, gated RMSNorm, out_proj.

    grouped_projection: Qwen3-Next's layout, in_proj_qkvz and in_proj_ba with
    each key head's q, k, v and z (b and a) rows together; otherwise Qwen3.5's,
    in_proj_qkv (q | k | v), in_proj_z, in_proj_b, in_proj_a.
    """

    linear_weights: ClassVar[tuple[str, ...]] = ("in_proj_weight", "out_weight")

    def __init__(self, config: ModelConfig, grouped_projection: bool,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        dims = config.linear_attention
        assert dims is not None, "a linear-attention layer needs the config's linear_* dims"
        self.dims = dims
        self.grouped = grouped_projection
        self.eps = config.rms_norm_eps
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        rows = dims.conv_channels + dims.value_size + 2 * dims.num_value_heads
        self.in_proj_weight = _weight(rows, config.hidden_size, **kw)
        self.conv_weight = _weight(dims.conv_channels, 1, dims.conv_kernel_size, **kw)
        self.a_log = _weight(dims.num_value_heads, **kw)
        self.dt_bias = _weight(dims.num_value_heads, **kw)
        self.norm_weight = _weight(dims.value_head_dim, **kw)
        self.out_weight = _weight(config.hidden_size, dims.value_size, **kw)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, pools: StatePools,
                ops: ReferenceOps) -> torch.Tensor:
        dims, tokens = self.dims, hidden.shape[0]
        assert meta.state_slots is not None and meta.state_fresh is not None, \
            "linear attention needs state slots"
        conv_states, states = pools
        mixed, z, b, a = self._split(ops.linear(hidden, self.in_proj_weight))
        mixed = ops.causal_conv1d(mixed, self.conv_weight[:, 0], None, conv_states, meta)
        q, k, v = mixed.split([dims.key_size, dims.key_size, dims.value_size], dim=-1)
        o = ops.gated_delta_rule(
            q.reshape(tokens, dims.num_key_heads, dims.key_head_dim),
            k.reshape(tokens, dims.num_key_heads, dims.key_head_dim),
            v.reshape(tokens, dims.num_value_heads, dims.value_head_dim),
            a, b, self.a_log, self.dt_bias, states, meta)
        out = ops.gated_rms_norm(o, z, self.norm_weight, self.eps)
        return ops.linear(out.reshape(tokens, dims.value_size), self.out_weight)

    def _split(self, projected: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, rows] -> (q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        dims, tokens = self.dims, projected.shape[0]
        hv, dv = dims.num_value_heads, dims.value_head_dim
        if not self.grouped:
            mixed, z, b, a = projected.split([dims.conv_channels, dims.value_size, hv, hv], dim=-1)
            return mixed, z.reshape(tokens, hv, dv), b, a
        heads, per_head = dims.num_key_heads, hv // dims.num_key_heads
        qkvz, ba = projected.split([dims.conv_channels + dims.value_size, 2 * hv], dim=-1)
        q, k, v, z = qkvz.reshape(tokens, heads, -1).split(
            [dims.key_head_dim, dims.key_head_dim, per_head * dv, per_head * dv], dim=-1)
        b, a = ba.reshape(tokens, heads, 2 * per_head).split([per_head, per_head], dim=-1)
        mixed = torch.cat([t.reshape(tokens, -1) for t in (q, k, v)], dim=-1)
        return mixed, z.reshape(tokens, hv, dv), b.reshape(tokens, hv), a.reshape(tokens, hv)

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        dims, w = self.dims, self.in_proj_weight
        if self.grouped:
            split = dims.conv_channels + dims.value_size
            projections = {"in_proj_qkvz": w[:split], "in_proj_ba": w[split:]}
        else:
            c, v, hv = dims.conv_channels, dims.value_size, dims.num_value_heads
            projections = {"in_proj_qkv": w[:c], "in_proj_z": w[c:c + v],
                           "in_proj_b": w[c + v:c + v + hv], "in_proj_a": w[c + v + hv:]}
        dests = {f"{prefix}.{name}.weight": rows for name, rows in projections.items()}
        dests.update({
            f"{prefix}.conv1d.weight": self.conv_weight,
            f"{prefix}.A_log": self.a_log,
            f"{prefix}.dt_bias": self.dt_bias,
            f"{prefix}.norm.weight": self.norm_weight,
            f"{prefix}.out_proj.weight": self.out_weight,
        })
        return dests
