"""The decoder-only transformer shared by the Llama, Qwen2 and Qwen3 families.

Pre-norm blocks: RMSNorm -> attention (fused q/k/v, RoPE, paged KV) -> residual
-> RMSNorm -> SwiGLU MLP (fused gate/up) -> residual. The residual add is
fused into the following norm (add_rms_norm), as between-layer kernels do.
Where the ops fuse a dense layer's projections (decode rows on the GPU:
kernels/skinny_fused.py), the layer runs with the stream summed instead:
each norm inside the projection after it, SwiGLU in the gate/up
projection's epilogue, each residual add in the epilogue of the projection
before it; the same values, six kernels instead of nine.
In the layers a mixture-of-experts config makes sparse, the MLP is swapped
for a SparseMoE block (engine/models/moe.py); nothing else changes.

Weights are allocated empty on the target device and filled in place by the
loaders through weight_destinations(), which names every slot by its Hugging
Face tensor name, so a checkpoint never exists twice in memory.

Tensor parallelism (engine/parallel/): a model built for one rank of several
holds that rank's share of each split tensor (ShardPlan), sized by the rank's
view of the config; o_proj and down_proj sum their partial products over the
ranks, the embedding sums each rank's vocabulary slice and the logits are
gathered from them. At world size 1 every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.fp8_weight import Fp8Weight
from engine.execution.model_ops import REFERENCE_OPS, ReferenceOps
from engine.execution.quantized_weight import QuantizedWeight
from engine.models.config import ModelConfig, MoEConfig
from engine.models.moe import QWEN_EXPERT_NAMES, ExpertTensorNames, SparseMoE
from engine.models.multimodal_inputs import MultimodalStepInputs
from engine.models.weight_alloc import empty_weight
from engine.parallel.sharding import Destination, ShardPlan, sharded
from engine.parallel.tensor_parallel import SINGLE_RANK, TensorParallel
from kernels.reference import build_rope_cache

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AttentionTraits:
    """What an architecture adds to plain attention, read from its config.json."""

    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool


def _weight(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    return empty_weight(shape, device, dtype)


class Attention(nn.Module):
    # The weights ops.linear multiplies by: a GGUF load may keep them packed
    # (engine/loader/packing.py puts a QuantizedWeight in their place).
    linear_weights: ClassVar[tuple[str, ...]] = ("qkv_weight", "o_weight")

    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 plan: ShardPlan | None = None) -> None:
        """config: the rank's view (plan.config); plan None: one device."""
        super().__init__()
        self.config = config
        self.plan = plan or ShardPlan.of(config, SINGLE_RANK)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.qkv_weight = _weight(config.qkv_size, config.hidden_size, **kw)
        self.qkv_bias = _weight(config.qkv_size, **kw) if config.attention_bias else None
        self.o_weight = _weight(config.hidden_size, config.q_size, **kw)
        self.o_bias = _weight(config.hidden_size, **kw) if config.o_proj_bias else None
        self.q_norm_weight = _weight(config.head_dim, **kw) if config.qk_norm else None
        self.k_norm_weight = _weight(config.head_dim, **kw) if config.qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rope_cache: torch.Tensor,
        ops: ReferenceOps,
    ) -> torch.Tensor:
        qkv = ops.linear(hidden, self.qkv_weight, self.qkv_bias)
        out = ops.attention(self.config, qkv, positions, meta, kv_cache, rope_cache,
                            self.q_norm_weight, self.k_norm_weight)
        return self.plan.tp.row_parallel_linear(ops, out, self.o_weight, self.o_bias)

    def weight_destinations(self, prefix: str) -> dict[str, Destination]:
        q, kv = self.config.q_size, self.config.kv_size
        plan = self.plan
        # Each part of the fused slot, and the checkpoint rows this rank keeps.
        parts = {
            "q_proj": (slice(0, q), plan.q_rows),
            "k_proj": (slice(q, q + kv), plan.kv_rows),
            "v_proj": (slice(q + kv, q + 2 * kv), plan.kv_rows),
        }
        dests = {f"{prefix}.{name}.weight": sharded(self.qkv_weight[rows], 0, shard)
                 for name, (rows, shard) in parts.items()}
        if self.qkv_bias is not None:
            dests.update({f"{prefix}.{name}.bias": sharded(self.qkv_bias[rows], 0, shard)
                          for name, (rows, shard) in parts.items()})
        dests[f"{prefix}.o_proj.weight"] = sharded(self.o_weight, 1, plan.q_rows)
        if self.o_bias is not None:
            dests[f"{prefix}.o_proj.bias"] = self.o_bias
        if self.q_norm_weight is not None:
            dests[f"{prefix}.q_norm.weight"] = self.q_norm_weight
            dests[f"{prefix}.k_norm.weight"] = self.k_norm_weight
        return dests


class MLP(nn.Module):
    checkpoint_name = "mlp"
    linear_weights: ClassVar[tuple[str, ...]] = ("gate_up_weight", "down_weight")

    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 plan: ShardPlan | None = None) -> None:
        """config: the rank's view (plan.config); plan None: one device."""
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.plan = plan or ShardPlan.of(config, SINGLE_RANK)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.gate_up_weight = _weight(2 * config.intermediate_size, config.hidden_size, **kw)
        self.down_weight = _weight(config.hidden_size, config.intermediate_size, **kw)

    def forward(self, hidden: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        gated = ops.silu_and_mul(ops.linear(hidden, self.gate_up_weight))
        return self.plan.tp.row_parallel_linear(ops, gated, self.down_weight, None)

    def weight_destinations(self, prefix: str) -> dict[str, Destination]:
        size, rows = self.intermediate_size, self.plan.mlp_rows
        return {
            f"{prefix}.gate_proj.weight": sharded(self.gate_up_weight[:size], 0, rows),
            f"{prefix}.up_proj.weight": sharded(self.gate_up_weight[size:], 0, rows),
            f"{prefix}.down_proj.weight": sharded(self.down_weight, 1, rows),
        }


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mlp: MLP | SparseMoE, device: torch.device | str,
                 dtype: torch.dtype, plan: ShardPlan | None = None) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_norm_weight = _weight(config.hidden_size, device=device, dtype=dtype)
        self.self_attn = Attention(config, device, dtype, plan)
        self.post_attention_norm_weight = _weight(config.hidden_size, device=device, dtype=dtype)
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rope_cache: torch.Tensor,
        ops: ReferenceOps,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (this layer's MLP output, residual stream before it); the next
        layer's input norm (or the final norm) adds the two. residual None, in
        and out: hidden is the whole stream (the embedding, or a sum formed
        already)."""
        if self._fused(hidden, ops):
            return self._fused_forward(hidden, residual, positions, meta, kv_cache, rope_cache,
                                       ops), None
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_norm_weight, self.eps)
        else:
            hidden, residual = ops.add_rms_norm(hidden, residual, self.input_norm_weight, self.eps)
        hidden = self.self_attn(hidden, positions, meta, kv_cache, rope_cache, ops)
        hidden, residual = ops.add_rms_norm(hidden, residual, self.post_attention_norm_weight,
                                            self.eps)
        return self.mlp(hidden, ops), residual

    def _fused(self, hidden: torch.Tensor, ops: ReferenceOps) -> bool:
        """Whether this step's layer runs as the fused kernels' dataflow: a
        dense layer of one rank, where ops fuse every projection (decode
        rows; kernels/skinny_fused.py)."""
        mlp, attn = self.mlp, self.self_attn
        return (isinstance(mlp, MLP) and mlp.plan.tp.world_size == 1
                and ops.fuses_dense_layer(hidden, (attn.qkv_weight, attn.o_weight,
                                                   mlp.gate_up_weight, mlp.down_weight)))

    def _fused_forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                       positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                       rope_cache: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        """The layer with the stream summed: each norm inside the projection
        after it, each residual add inside the projection before it (the
        stream updated in place). Returns the stream after the layer; the
        values are those of forward's unfused path."""
        stream = hidden if residual is None else hidden + residual
        attn, mlp = self.self_attn, self.mlp
        qkv = ops.norm_linear(stream, self.input_norm_weight, self.eps, attn.qkv_weight,
                              attn.qkv_bias)
        out = ops.attention(attn.config, qkv, positions, meta, kv_cache, rope_cache,
                            attn.q_norm_weight, attn.k_norm_weight)
        stream = ops.linear_add_(out, attn.o_weight, attn.o_bias, stream)
        gated = ops.norm_swiglu(stream, self.post_attention_norm_weight, self.eps,
                                mlp.gate_up_weight)
        return ops.linear_add_(gated, mlp.down_weight, None, stream)

    def weight_destinations(self, prefix: str, stacked_experts: bool = False
                            ) -> dict[str, Destination]:
        mlp_prefix = f"{prefix}.{self.mlp.checkpoint_name}"
        # SparseMoE, and SharedExpertMoE around one (Qwen2-MoE), can take stacks.
        stacked = getattr(self.mlp, "stacked_weight_destinations", None)
        if stacked_experts and stacked is not None:
            mlp = stacked(mlp_prefix)
        else:
            mlp = self.mlp.weight_destinations(mlp_prefix)
        return {
            f"{prefix}.input_layernorm.weight": self.input_norm_weight,
            f"{prefix}.post_attention_layernorm.weight": self.post_attention_norm_weight,
            **self.self_attn.weight_destinations(f"{prefix}.self_attn"),
            **mlp,
        }


def _add_deepstack(hidden: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor,
                   features: torch.Tensor) -> tuple[torch.Tensor, None]:
    """A layer's output stream (hidden + residual, the sum the next norm would
    form) with features added at rows, as transformers' Qwen3-VL adds them
    after the layer's residual add; residual None: the next layer starts from
    a plain norm of it, so the sums round as transformers' do."""
    summed = hidden if residual is None else residual + hidden
    summed[rows] += features.to(summed.dtype)
    return summed, None


def experts_on_host(layer: int, host_expert_layers: int) -> bool:
    """Whether a layer's routed experts stay in host memory when the first
    host_expert_layers layers' do (-1: every layer's)."""
    return host_expert_layers < 0 or layer < host_expert_layers


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache.

    Subclasses (one file per architecture) say how their config.json maps to
    attention traits and how their GGUF tensors were laid out.
    """

    # general.architecture of GGUF files holding this model, if any.
    gguf_architecture: ClassVar[str | None] = None
    # llama.cpp's converter interleaves the rows of attn_q/attn_k for some families.
    gguf_permuted_qk: ClassVar[bool] = False
    # How checkpoints of a mixture-of-experts architecture name the experts.
    expert_tensor_names: ClassVar[ExpertTensorNames] = QWEN_EXPERT_NAMES
    # Whether this class's GGUF files carry experts ({arch}.expert_count > 0):
    # llama.cpp writes Llama and Mixtral under the same "llama" architecture.
    gguf_has_experts: ClassVar[bool] = False
    # An untied lm_head may be kept packed (a tied one is the embedding table).
    linear_weights: ClassVar[tuple[str, ...]] = ("lm_head",)

    @classmethod
    def hf_traits(cls, cfg: dict[str, Any]) -> AttentionTraits:
        bias = bool(cfg.get("attention_bias", False))
        return AttentionTraits(qkv_bias=bias, o_proj_bias=bias, qk_norm=False)

    @classmethod
    def hf_moe(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        """The mixture-of-experts facts of config.json; None for a dense model."""
        return None

    @classmethod
    def hf_hybrid(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields of a hybrid model's config.json (layer types,
        linear-attention dims, partial rotary, attention output gate); none here."""
        return {}

    @classmethod
    def hf_multimodal(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields of a vision-language model's text config
        (mrope_section, mrope_interleaved); none for a text model."""
        return {}

    @classmethod
    def gguf_multimodal(cls, meta: Any) -> dict[str, Any]:
        """hf_multimodal's fields from a GGUF file's metadata (meta: config._GGUFFields)."""
        return {}

    @classmethod
    def gguf_hybrid(cls, meta: Any, num_layers: int, head_dim: int) -> dict[str, Any]:
        """hf_hybrid's fields from a GGUF file's metadata (meta: config._GGUFFields)."""
        return {}

    @classmethod
    def gguf_moe(cls, num_experts: int, experts_per_token: int, intermediate_size: int,
                 weights_norm: bool | None, num_layers: int) -> MoEConfig:
        """The mixture-of-experts facts of a GGUF file's {arch}.expert_* keys
        (weights_norm: expert_weights_norm, None where the file lacks it)."""
        raise ValueError(f"{cls.__name__} GGUF files have no experts")

    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 host_expert_layers: int = 0, tp: TensorParallel = SINGLE_RANK) -> None:
        """host_expert_layers: how many of the first layers keep their routed
        experts in host memory (SparseMoE.host_resident); -1: every layer.
        tp: the rank to build (ValueError where config does not split); the
        model's config is then the rank's view (ShardPlan.config)."""
        super().__init__()
        self.plan = ShardPlan.of(config, tp)
        config = self.plan.config
        self.config = config
        self.host_expert_layers = host_expert_layers
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        vocab_rows = self.plan.vocab_rows.length
        self.embed_tokens = _weight(vocab_rows, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self._mlp(config, index, device, dtype), device, dtype,
                         self.plan)
            for index in range(config.num_layers)
        )
        self.norm_weight = _weight(config.hidden_size, **kw)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight(vocab_rows, config.hidden_size, **kw)
        )
        rope = build_rope_cache(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            device,
            dtype,
        )
        self.register_buffer("rope_cache", rope, persistent=False)
        # The ModelRunner switches this to CudaOps where our kernels can run.
        self.ops: ReferenceOps = REFERENCE_OPS

    def _mlp(self, config: ModelConfig, layer: int, device: torch.device | str,
             dtype: torch.dtype) -> MLP | SparseMoE:
        if config.moe is not None and config.moe.is_sparse(layer):
            return SparseMoE(config, self.expert_tensor_names, device, dtype,
                             host_resident=experts_on_host(layer, self.host_expert_layers))
        return MLP(config, device, dtype, self.plan)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        multimodal: MultimodalStepInputs | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T]; kv_caches[layer] = (k_cache, v_cache),
        each [P, S, Hkv, D] in the model dtype. Writes the new tokens' K/V at
        meta.slot_mapping and returns the final-normed hidden states [T, H].
        multimodal: a prefill step's image embeddings, rope table and
        deepstack features (vision-language models); None for text steps."""
        ops = self.ops
        hidden = self.plan.tp.vocab_embedding(input_ids, self.embed_tokens,
                                              self.plan.vocab_rows.start)
        rope_cache = self.rope_cache
        deepstack: tuple[torch.Tensor, ...] = ()
        if multimodal is not None:
            hidden.index_copy_(0, multimodal.rows, multimodal.embeddings.to(hidden.dtype))
            if multimodal.rope_table is not None:
                rope_cache = multimodal.rope_table
                positions = torch.arange(hidden.shape[0], device=hidden.device)
            deepstack = multimodal.deepstack
        residual: torch.Tensor | None = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden, residual = layer(hidden, residual, positions, meta, kv_cache, rope_cache, ops)
            if index < len(deepstack):
                assert multimodal is not None
                hidden, residual = _add_deepstack(hidden, residual, multimodal.rows,
                                                  deepstack[index])
        if residual is None:  # the last layer ran fused, or deepstack left the sum in hidden
            return ops.rms_norm(hidden, self.norm_weight, self.config.rms_norm_eps)
        hidden, _ = ops.add_rms_norm(hidden, residual, self.norm_weight, self.config.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> float32 [N, vocab_size]."""
        # Batch-invariant ops (--deterministic) compute each row's logits alone too.
        if isinstance(self.lm_head, (QuantizedWeight, Fp8Weight)) or self.ops.deterministic:
            logits = self.ops.linear(hidden, self.lm_head).float()
        else:
            logits = F.linear(hidden, self.lm_head).float()
        # Under tensor parallelism, this rank's vocabulary slice of them.
        return self.plan.tp.gather_vocab(logits, self.plan.vocab_per_rank,
                                         self.config.vocab_size)

    def weight_destinations(self, stacked_experts: bool = False) -> dict[str, Destination]:
        """Every weight slot (a parameter or a row slice of a fused one) by its
        Hugging Face tensor name; a tied lm_head has no slot of its own.
        stacked_experts: one slot per expert matrix of a layer rather than one
        per expert (SparseMoE.stacked_weight_destinations). Under tensor
        parallelism a split tensor's slot is a ShardedSlot: the rank's part."""
        vocab = self.plan.vocab_rows
        dests: dict[str, Destination] = {
            "model.embed_tokens.weight": sharded(self.embed_tokens, 0, vocab),
            "model.norm.weight": self.norm_weight,
        }
        if not self.config.tie_word_embeddings:
            dests["lm_head.weight"] = sharded(self.lm_head, 0, vocab)
        for index, layer in enumerate(self.layers):
            dests.update(layer.weight_destinations(f"model.layers.{index}", stacked_experts))
        return dests
