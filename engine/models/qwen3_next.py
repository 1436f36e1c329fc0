"""Qwen3-Next and Qwen3.5 (text): hybrid decoders of Gated DeltaNet and gated full attention.

Every layer_types entry picks a layer's token mixer: "linear_attention" (a
GatedDeltaNet, most layers) or "full_attention" (a GatedAttention, every
full_attention_interval-th layer). The MLP is Qwen3-Next's routed experts with
a gated shared expert in its sparse layers, a dense SwiGLU elsewhere and in
all of Qwen3.5's. All RMSNorms but the Gated DeltaNet's output norm are
zero-centred (engine/models/hybrid_layers.py).

kv_caches[layer] is (k_cache, v_cache) for a full-attention layer and
(conv_states [S, C, K-1], states [S, Hv, Dk, Dv]) for a linear-attention
one; the metadata's state_slots / state_fresh say which slot each sequence's
state lives in and whether it starts from zero.

NOTE: these classes run on the CPU reference ops and are checked against
transformers (tests/engine/test_hybrid_models.py); they are not in the served
architecture table (engine/models/__init__.py) until the engine keeps state slots.
Qwen3.5 here is the text model (Qwen3_5ForCausalLM, model.* names); the
multimodal checkpoints' model.language_model.* prefix and Qwen3-Next's mtp.*
tensors are not mapped yet.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.model_ops import REFERENCE_OPS, ReferenceOps
from engine.models.config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    LinearAttentionConfig,
    ModelConfig,
    MoEConfig,
    hf_partial_rotary_factor,
)
from engine.models.decoder import MLP, AttentionTraits, CausalLM, experts_on_host
from engine.models.hybrid_layers import (
    GatedAttention,
    GatedDeltaNet,
    StatePools,
    zero_centred_rms_norm,
)
from engine.models.shared_expert_moe import SharedExpertMoE
from kernels.reference import build_rope_cache

# transformers' defaults where a config.json leaves these out.
_DEFAULT_PARTIAL_ROTARY = 0.25
_DEFAULT_FULL_ATTENTION_INTERVAL = 4


def _weight(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class HybridLayer(nn.Module):
    """Zero-centred pre-norm block: x + mixer(norm(x)), then + mlp(norm(...))."""

    def __init__(self, config: ModelConfig, mixer: GatedAttention | GatedDeltaNet,
                 mlp: MLP | SharedExpertMoE, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_norm_weight = _weight(config.hidden_size, device=device, dtype=dtype)
        self.post_attention_norm_weight = _weight(config.hidden_size, device=device, dtype=dtype)
        self.mixer = mixer
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: StatePools, rope_cache: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        normed = zero_centred_rms_norm(hidden, self.input_norm_weight, self.eps)
        if isinstance(self.mixer, GatedDeltaNet):
            mixed = self.mixer(normed, meta, cache, ops)
        else:
            mixed = self.mixer(normed, positions, meta, cache, rope_cache, ops)
        hidden = hidden + mixed
        return hidden + self.mlp(zero_centred_rms_norm(hidden, self.post_attention_norm_weight,
                                                       self.eps), ops)

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        mixer = "linear_attn" if isinstance(self.mixer, GatedDeltaNet) else "self_attn"
        return {
            f"{prefix}.input_layernorm.weight": self.input_norm_weight,
            f"{prefix}.post_attention_layernorm.weight": self.post_attention_norm_weight,
            **self.mixer.weight_destinations(f"{prefix}.{mixer}"),
            **self.mlp.weight_destinations(f"{prefix}.mlp"),
        }


class HybridCausalLM(CausalLM):
    """The shared hybrid decoder; subclasses name the projection layout and the MLP."""

    # Qwen3-Next's in_proj_qkvz / in_proj_ba group rows per key head.
    grouped_linear_projection: ClassVar[bool] = False

    @classmethod
    def hf_traits(cls, cfg: dict[str, Any]) -> AttentionTraits:
        bias = bool(cfg.get("attention_bias", False))
        return AttentionTraits(qkv_bias=bias, o_proj_bias=bias, qk_norm=True)

    @classmethod
    def hf_hybrid(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        layers = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if not types:
            interval = int(cfg.get("full_attention_interval", _DEFAULT_FULL_ATTENTION_INTERVAL))
            types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                     for i in range(layers)]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
        return {
            "layer_types": tuple(types),
            "linear_attention": LinearAttentionConfig(
                num_key_heads=int(cfg["linear_num_key_heads"]),
                num_value_heads=int(cfg["linear_num_value_heads"]),
                key_head_dim=int(cfg["linear_key_head_dim"]),
                value_head_dim=int(cfg["linear_value_head_dim"]),
                conv_kernel_size=int(cfg["linear_conv_kernel_dim"]),
            ),
            "partial_rotary_factor": hf_partial_rotary_factor(cfg, _DEFAULT_PARTIAL_ROTARY),
        }

    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 host_expert_layers: int = 0) -> None:
        # Builds its own layers: CausalLM.__init__ would build plain decoder layers.
        nn.Module.__init__(self)
        self.config = config
        self.host_expert_layers = host_expert_layers
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            HybridLayer(config, self._mixer(config, index, device, dtype),
                        self._mlp(config, index, device, dtype), device, dtype)
            for index in range(config.num_layers)
        )
        self.norm_weight = _weight(config.hidden_size, **kw)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _weight(config.vocab_size, config.hidden_size, **kw))
        rope = build_rope_cache(config.rotary_dim, config.max_position_embeddings,
                                config.rope_theta, config.rope_scaling, device, dtype)
        self.register_buffer("rope_cache", rope, persistent=False)
        self.ops: ReferenceOps = REFERENCE_OPS

    def _mixer(self, config: ModelConfig, layer: int, device: torch.device | str,
               dtype: torch.dtype) -> GatedAttention | GatedDeltaNet:
        if config.is_linear_attention(layer):
            return GatedDeltaNet(config, self.grouped_linear_projection, device, dtype)
        return GatedAttention(config, device, dtype)

    def _mlp(self, config: ModelConfig, layer: int, device: torch.device | str,
             dtype: torch.dtype) -> MLP | SharedExpertMoE:
        if config.moe is not None and config.moe.is_sparse(layer):
            return SharedExpertMoE(config, self.expert_tensor_names, device, dtype,
                                   host_resident=experts_on_host(layer, self.host_expert_layers))
        return MLP(config, device, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[StatePools]) -> torch.Tensor:
        """As CausalLM.forward; a linear-attention layer's kv_caches entry is
        its (conv_states, states) pools, updated in place at meta.state_slots."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, meta, cache, self.rope_cache, self.ops)
        return zero_centred_rms_norm(hidden, self.norm_weight, self.config.rms_norm_eps)

    def weight_destinations(self, stacked_experts: bool = False) -> dict[str, torch.Tensor]:
        if stacked_experts:
            raise ValueError(f"{type(self).__name__} has no GGUF (stacked-expert) layout yet")
        dests = {"model.embed_tokens.weight": self.embed_tokens,
                 "model.norm.weight": self.norm_weight}
        if not self.config.tie_word_embeddings:
            dests["lm_head.weight"] = self.lm_head
        for index, layer in enumerate(self.layers):
            dests.update(layer.weight_destinations(f"model.layers.{index}"))
        return dests


class Qwen3NextForCausalLM(HybridCausalLM):
    grouped_linear_projection = True

    @classmethod
    def hf_moe(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        num_experts = int(cfg.get("num_experts") or 0)
        if num_experts == 0:
            return None
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_only = set(cfg.get("mlp_only_layers") or ())
        layers = int(cfg["num_hidden_layers"])
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if shared == 0:
            raise ValueError("Qwen3-Next without a shared expert "
                             "(shared_expert_intermediate_size 0) is not supported")
        return MoEConfig(
            num_experts=num_experts,
            experts_per_token=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            normalize_topk=bool(cfg.get("norm_topk_prob", True)),
            sparse_layers=tuple(layer for layer in range(layers)
                                if layer not in dense_only and (layer + 1) % step == 0),
            shared_expert_intermediate_size=shared,
        )


class Qwen3_5ForCausalLM(HybridCausalLM):
    """Qwen3.5's text decoder: dense MLPs, separate in_proj_qkv/z/b/a. Its
    interleaved multimodal RoPE gives text positions (all three axes equal)
    the plain partial RoPE."""
