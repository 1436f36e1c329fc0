"""Qwen3-Next and Qwen3.5 (text): hybrid decoders of Gated DeltaNet and gated full attention.

Every layer_types entry picks a layer's token mixer: "linear_attention" (a
GatedDeltaNet, most layers) or "full_attention" (a GatedAttention, every
full_attention_interval-th layer). The MLP is Qwen3-Next's routed experts with
a gated shared expert in its sparse layers, a dense SwiGLU elsewhere and in
all of Qwen3.5's. All RMSNorms but the Gated DeltaNet's output norm are
zero-centred (engine/models/hybrid_layers.py).

forward()'s kv_caches hold the paged (k_cache, v_cache) of the full-attention
layers only, in layer order, as the engine's KV pool does; the
linear-attention layers read their (conv_states [S, C, K-1], states [S, Hv,
Dk, Dv]) from the recurrent state pools attached with attach_state()
(engine/execution/recurrent_state.py). The metadata's state_slots /
state_fresh say which row each sequence's state lives in and whether it
starts from zero.

Checked token for token against transformers on the CPU
(tests/engine/test_hybrid_models.py, tests/engine/test_hybrid_serving.py).
Qwen3.5 here is the text model (Qwen3_5ForCausalLM, model.* names); the HF
loader reads Qwen3.5's multimodal checkpoints as it (engine/loader/hf_weights.py)
and the GGUF loader undoes llama.cpp's qwen3next / qwen35 / qwen35moe layouts
(engine/loader/gguf_hybrid.py). Their MTP head is loaded only for --spec mtp
(add_mtp_head, engine/models/mtp_head.py); otherwise both loaders skip it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

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
from engine.models.hybrid_layers import GatedAttention, GatedDeltaNet, StatePools
from engine.models.mtp_head import MTPHead
from engine.models.shared_expert_moe import SharedExpertMoE
from engine.models.weight_alloc import empty_weight
from engine.parallel.sharding import ShardPlan
from engine.parallel.tensor_parallel import SINGLE_RANK, TensorParallel
from kernels.reference import build_rope_cache

if TYPE_CHECKING:
    from engine.execution.recurrent_state import RecurrentStatePools

# transformers' defaults where a config.json leaves these out.
_DEFAULT_PARTIAL_ROTARY = 0.25
_DEFAULT_FULL_ATTENTION_INTERVAL = 4


def _weight(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    return empty_weight(shape, device, dtype)


def _every_nth_full_attention(num_layers: int, interval: int) -> tuple[str, ...]:
    """Layer types when a config gives only full_attention_interval: every
    interval-th layer (1-based) full attention, the rest linear."""
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                 for i in range(num_layers))


class HybridLayer(nn.Module):
    """Zero-centred pre-norm block: x + mixer(norm(x)), then + mlp(norm(...)).
    As DecoderLayer, the residual add is fused into the following norm
    (ops.add_zero_centred_rms_norm: a bf16 add, then the norm, as transformers)."""

    def __init__(self, config: ModelConfig, mixer: GatedAttention | GatedDeltaNet,
                 mlp: MLP | SharedExpertMoE, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_norm_weight = _weight(config.hidden_size, device=device, dtype=dtype)
        self.post_attention_norm_weight = _weight(config.hidden_size, device=device, dtype=dtype)
        self.mixer = mixer
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, meta: AttentionMetadata, cache: StatePools,
                rope_cache: torch.Tensor, ops: ReferenceOps
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before it); the next
        layer's input norm (or the final norm) adds the two."""
        if residual is None:
            residual = hidden
            normed = ops.zero_centred_rms_norm(hidden, self.input_norm_weight, self.eps)
        else:
            normed, residual = ops.add_zero_centred_rms_norm(hidden, residual,
                                                             self.input_norm_weight, self.eps)
        if isinstance(self.mixer, GatedDeltaNet):
            mixed = self.mixer(normed, meta, cache, ops)
        else:
            mixed = self.mixer(normed, positions, meta, cache, rope_cache, ops)
        normed, residual = ops.add_zero_centred_rms_norm(mixed, residual,
                                                         self.post_attention_norm_weight, self.eps)
        return self.mlp(normed, ops), residual

    def weight_destinations(self, prefix: str, stacked_experts: bool = False
                            ) -> dict[str, torch.Tensor]:
        mixer = "linear_attn" if isinstance(self.mixer, GatedDeltaNet) else "self_attn"
        if stacked_experts and isinstance(self.mlp, SharedExpertMoE):
            mlp = self.mlp.stacked_weight_destinations(f"{prefix}.mlp")
        else:
            mlp = self.mlp.weight_destinations(f"{prefix}.mlp")
        return {
            f"{prefix}.input_layernorm.weight": self.input_norm_weight,
            f"{prefix}.post_attention_layernorm.weight": self.post_attention_norm_weight,
            **self.mixer.weight_destinations(f"{prefix}.{mixer}"),
            **mlp,
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
            types = _every_nth_full_attention(
                layers, int(cfg.get("full_attention_interval", _DEFAULT_FULL_ATTENTION_INTERVAL)))
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
            # Qwen3-Next names them num_nextn_predict_layers, Qwen3.5 mtp_num_hidden_layers.
            "mtp_layers": int(cfg.get("mtp_num_hidden_layers")
                              or cfg.get("num_nextn_predict_layers") or 0),
        }

    @classmethod
    def gguf_hybrid(cls, meta: Any, num_layers: int, head_dim: int) -> dict[str, Any]:
        """The same fields from llama.cpp's metadata (meta: config._GGUFFields):
        the converter writes the Gated DeltaNet dims as ssm.* keys (group_count:
        key heads, time_step_rank: value heads, state_size: key head dim,
        inner_size: value heads x value head dim, conv_kernel), the layer
        pattern as full_attention_interval and the rotated dims per head as
        rope.dimension_count."""
        arch = meta.architecture
        value_heads = int(meta.get(f"{arch}.ssm.time_step_rank"))
        inner = int(meta.get(f"{arch}.ssm.inner_size"))
        rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        factor = rotary / head_dim
        if inner % value_heads or int(head_dim * factor) != rotary:
            raise ValueError(f"GGUF {arch}: ssm.inner_size {inner} over {value_heads} value "
                             f"heads, or {rotary} rotary dims of {head_dim}, do not divide")
        interval = int(meta.get(f"{arch}.full_attention_interval",
                                _DEFAULT_FULL_ATTENTION_INTERVAL))
        return {
            "layer_types": _every_nth_full_attention(num_layers, interval),
            "linear_attention": LinearAttentionConfig(
                num_key_heads=int(meta.get(f"{arch}.ssm.group_count")),
                num_value_heads=value_heads,
                key_head_dim=int(meta.get(f"{arch}.ssm.state_size")),
                value_head_dim=inner // value_heads,
                conv_kernel_size=int(meta.get(f"{arch}.ssm.conv_kernel")),
            ),
            "partial_rotary_factor": factor,
            "mtp_layers": int(meta.get(f"{arch}.nextn_predict_layers", 0)),
        }

    @classmethod
    def gguf_moe(cls, num_experts: int, experts_per_token: int, intermediate_size: int,
                 weights_norm: bool | None, num_layers: int) -> MoEConfig:
        # llama.cpp's qwen3next / qwen35moe graphs put experts in every layer and
        # renormalise the top-k weights (the converter writes no norm_topk_prob;
        # every released checkpoint sets it); a file that says otherwise is obeyed.
        # The shared expert's size is read by ModelConfig.from_gguf.
        return MoEConfig(
            num_experts=num_experts,
            experts_per_token=experts_per_token,
            intermediate_size=intermediate_size,
            normalize_topk=True if weights_norm is None else weights_norm,
            sparse_layers=tuple(range(num_layers)),
        )

    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 host_expert_layers: int = 0, tp: TensorParallel = SINGLE_RANK) -> None:
        # Builds its own layers: CausalLM.__init__ would build plain decoder layers.
        nn.Module.__init__(self)
        # ValueError for tp of several ranks: hybrid layers are not split (yet).
        self.plan = ShardPlan.of(config, tp)
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
        self.state_pools: RecurrentStatePools | None = None
        self.mtp: MTPHead | None = None  # add_mtp_head(), for --spec mtp

    def add_mtp_head(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Build the checkpoint's MTP head (its weights come with the rest:
        weight_destinations names them). Its layer is gated full attention
        with the model's kind of MLP: routed experts and a shared expert in
        the MoE models, a dense MLP in Qwen3.5."""
        config = self.config
        if config.mtp_layers < 1:
            raise ValueError(f"--spec mtp: this {config.architecture} checkpoint has no MTP "
                             "layers (mtp.* / nextn tensors)")
        mlp: MLP | SharedExpertMoE = (
            SharedExpertMoE(config, self.expert_tensor_names, device, dtype)
            if config.moe is not None else MLP(config, device, dtype))
        layer = HybridLayer(config, GatedAttention(config, device, dtype), mlp, device, dtype)
        self.mtp = MTPHead(config, layer, device, dtype)

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

    def attach_state(self, pools: RecurrentStatePools) -> None:
        """The recurrent state pools the linear-attention layers read and update."""
        self.state_pools = pools

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[StatePools]) -> torch.Tensor:
        """As CausalLM.forward; kv_caches holds the full-attention layers'
        pages, and a linear-attention layer updates its rows of the attached
        state pools at meta.state_slots."""
        pools = self.state_pools
        assert pools is not None, "a hybrid model needs its state pools attached"
        assert len(kv_caches) == self.config.num_attention_layers
        paged = iter(kv_caches)
        # A verify step's attention rows are single tokens; the recurrent
        # state runs over each sequence's tokens together.
        state_meta = meta.for_recurrent_state()
        ops = self.ops
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            if self.config.is_linear_attention(index):
                hidden, residual = layer(hidden, residual, positions, state_meta,
                                         pools.layer(index), self.rope_cache, ops)
            else:
                hidden, residual = layer(hidden, residual, positions, meta, next(paged),
                                         self.rope_cache, ops)
        assert residual is not None, "a model has at least one layer"
        hidden, _ = ops.add_zero_centred_rms_norm(hidden, residual, self.norm_weight,
                                                  self.config.rms_norm_eps)
        return hidden

    def weight_destinations(self, stacked_experts: bool = False) -> dict[str, torch.Tensor]:
        dests = {"model.embed_tokens.weight": self.embed_tokens,
                 "model.norm.weight": self.norm_weight}
        if not self.config.tie_word_embeddings:
            dests["lm_head.weight"] = self.lm_head
        for index, layer in enumerate(self.layers):
            dests.update(layer.weight_destinations(f"model.layers.{index}", stacked_experts))
        if self.mtp is not None:
            dests.update(self.mtp.weight_destinations(stacked_experts))
        return dests


class Qwen3NextForCausalLM(HybridCausalLM):
    grouped_linear_projection = True
    gguf_architecture = "qwen3next"
    gguf_has_experts = True

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

    gguf_architecture = "qwen35"


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's mixture-of-experts text decoder: Qwen3.5's layers, every
    MLP routed experts (always renormalised) plus a gated shared expert."""

    gguf_architecture = "qwen35moe"
    gguf_has_experts = True

    @classmethod
    def hf_moe(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if shared == 0:
            raise ValueError("Qwen3.5-MoE without a shared expert "
                             "(shared_expert_intermediate_size 0) is not supported")
        # transformers' router divides the top-k weights by their sum, whatever
        # the config says, and every layer is sparse.
        return MoEConfig(
            num_experts=int(cfg["num_experts"]),
            experts_per_token=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            normalize_topk=True,
            sparse_layers=tuple(range(int(cfg["num_hidden_layers"]))),
            shared_expert_intermediate_size=shared,
        )
