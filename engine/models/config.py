"""ModelConfig: the shape of a decoder-only model, read from config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from gguf.quants import dequantize

from kernels.reference import SUPPORTED_ROPE_TYPES

if TYPE_CHECKING:  # the model classes import this module, and the loaders them
    from engine.loader.gguf_file import GGUFFile
    from engine.models.decoder import CausalLM

# Keys a rope scaling dict of each type must carry.
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "freq_factors": ("factors",),
}


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLP of the layers listed in sparse_layers; the
    other layers keep a dense MLP of ModelConfig.intermediate_size."""

    num_experts: int
    experts_per_token: int  # top-k
    intermediate_size: int  # of one expert
    normalize_topk: bool  # divide the k routing weights by their sum
    sparse_layers: tuple[int, ...]
    # Mixtral keeps the routing weights in float32 and weighs expert outputs in
    # float32; Qwen3-MoE casts the weights to the model dtype first.
    weigh_in_float32: bool = False
    # Qwen3-Next: one always-on SwiGLU expert of this size beside the routed
    # ones, its output scaled by sigmoid(shared_expert_gate(x)); 0: none.
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"{self.experts_per_token} experts per token with {self.num_experts} experts"
            )

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5):
    a causal depthwise conv over q|k|v, then a recurrent state per value head
    (kernels/gated_delta_reference.py)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"{self.num_value_heads} linear-attention value heads are not a "
                             f"multiple of {self.num_key_heads} key heads")

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the conv (and of its state): q, k and v."""
        return 2 * self.key_size + self.value_size

    def conv_state_shape(self, num_slots: int) -> tuple[int, int, int]:
        return (num_slots, self.conv_channels, self.conv_kernel_size - 1)

    def state_shape(self, num_slots: int) -> tuple[int, int, int, int]:
        return (num_slots, self.num_value_heads, self.key_head_dim, self.value_head_dim)


# ModelConfig.layer_types entries.
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None, or {"rope_type": "linear" | "llama3" | "freq_factors", ...}; see
    # kernels.reference.rope_inverse_frequencies for the keys of each type.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on the q/k/v projections
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # No token ids (BOS, EOS): those are the tokenizer's facts, and the router
    # owns the tokenizer; it sends the end tokens with each request.
    # Bias on the attention output projection (Llama's and Qwen3's attention_bias).
    o_proj_bias: bool = False
    # None for dense models.
    moe: MoEConfig | None = None
    # Hybrid models (Qwen3-Next, Qwen3.5): each layer's token mixer, FULL_ATTENTION
    # or LINEAR_ATTENTION; () means full attention everywhere.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionConfig | None = None
    # RoPE rotates the first rotary_dim = head_dim * factor dims of each head.
    partial_rotary_factor: float = 1.0
    # Multi-token-prediction layers the checkpoint carries after its decoder
    # (Qwen3-Next's and Qwen3.5's mtp.*): --spec mtp drafts with them
    # (engine/models/mtp_head.py); num_layers does not count them.
    mtp_layers: int = 0
    # Vision-language models (Qwen2.5-VL, Qwen3-VL): multimodal RoPE splits the
    # rotary_dim/2 frequencies among the temporal, height and width position
    # axes, in contiguous sections or interleaved t,h,w (engine/models/mrope.py);
    # () for text models, whose one position drives every frequency.
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives "
                             f"{self.rotary_dim} rotary dims of {self.head_dim}; need an even "
                             "count > 0")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"{len(self.layer_types)} layer types for "
                                 f"{self.num_layers} layers")
            unknown = set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
            if unknown:
                raise ValueError(f"layer types {sorted(unknown)} are not supported")
            if LINEAR_ATTENTION in self.layer_types and self.linear_attention is None:
                raise ValueError("linear-attention layers need the linear_* dims")
        if self.moe is not None and any(
            not 0 <= layer < self.num_layers for layer in self.moe.sparse_layers
        ):
            raise ValueError(f"sparse layers {self.moe.sparse_layers} outside {self.num_layers} layers")
        if self.mrope_section and sum(self.mrope_section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} sums to "
                             f"{sum(self.mrope_section)}; the rotary frequencies number "
                             f"{self.rotary_dim // 2}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope scaling type {rope_type!r} is not supported (supported: none, "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a checkpoint without it"
                )
            missing = [key for key in _ROPE_KEYS[rope_type] if key not in self.rope_scaling]
            if missing:
                raise ValueError(f"{rope_type} rope scaling lacks {', '.join(missing)}")

    # -- derived values -------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_attention(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def has_recurrent_state(self) -> bool:
        """A hybrid model: some layers carry recurrent state, not KV pages."""
        return LINEAR_ATTENTION in self.layer_types

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep K and V in the paged cache."""
        return sum(1 for layer in range(self.num_layers) if not self.is_linear_attention(layer))

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V, all layers, that one cached token takes."""
        return 2 * self.num_attention_layers * self.kv_size * dtype.itemsize

    def kv_cache_shape(self, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        """Shape of each layer's k_cache and v_cache tensor."""
        return (num_pages, page_size, self.num_kv_heads, self.head_dim)

    # -- readers --------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any],
                       model_cls: type[CausalLM] | None = None) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4 or 5 layout).
        model_cls: the class to read it for; by default the served class that
        the config's architectures entry names."""
        try:
            return cls._from_hf_config(cfg, model_cls)
        except KeyError as exc:
            raise ValueError(
                f"config.json lacks {exc.args[0]!r}; the model config is incomplete"
            ) from None

    @classmethod
    def _from_hf_config(cls, cfg: dict[str, Any],
                        model_cls: type[CausalLM] | None) -> ModelConfig:
        # Imported here: the registry imports the model classes, which import this module.
        from engine.models import model_class

        architectures = cfg.get("architectures") or []
        if not architectures:
            raise ValueError(
                "config.json has no 'architectures' entry; it does not name the model class"
            )
        architecture = architectures[0]
        cls_of_model = model_cls or model_class(architecture)
        traits = cls_of_model.hf_traits(cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _hf_rope(cfg)
        hybrid = cls_of_model.hf_hybrid(cfg)
        moe = cls_of_model.hf_moe(cfg)
        # A model whose every layer is sparse (Qwen3.5-MoE) names no dense MLP size.
        dense_size = cfg.get("intermediate_size") or (
            moe.intermediate_size if moe is not None
            and len(moe.sparse_layers) == int(cfg["num_hidden_layers"]) else cfg["intermediate_size"])
        if hf_partial_rotary_factor(cfg) != 1.0 and "partial_rotary_factor" not in hybrid:
            raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not "
                             "supported")
        return cls(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(dense_size),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_hf_context_length(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=traits.qkv_bias,
            qk_norm=traits.qk_norm,
            o_proj_bias=traits.o_proj_bias,
            moe=moe,
            **hybrid,
            **cls_of_model.hf_multimodal(cfg),
        )

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> ModelConfig:
        """Read the metadata and tensor table of an opened GGUF file."""
        from engine.models import gguf_architecture, model_class

        meta = _GGUFFields(gguf_file)
        arch = meta.architecture
        num_experts = int(meta.get(f"{arch}.expert_count", 0))
        architecture = gguf_architecture(arch, has_experts=num_experts > 0)
        # llama.cpp counts MTP (next-token prediction) blocks as the last
        # nextn_predict_layers blocks; the loader skips them.
        num_layers = (int(meta.get(f"{arch}.block_count"))
                      - int(meta.get(f"{arch}.nextn_predict_layers", 0)))
        model_cls = model_class(architecture)
        moe = _gguf_moe(meta, model_cls, num_experts, num_layers)
        hidden = int(meta.get(f"{arch}.embedding_length"))
        num_heads = int(meta.get(f"{arch}.attention.head_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
        value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
        rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        # Partial rotary embeddings only where the class reads them (gguf_hybrid).
        hybrid = model_cls.gguf_hybrid(meta, num_layers, head_dim)
        partial_rotary = "partial_rotary_factor" in hybrid
        # Attention traits from a full-attention block (a hybrid's block 0 may be linear).
        block = next((i for i, kind in enumerate(hybrid.get("layer_types", ()))
                      if kind == FULL_ATTENTION), 0)
        if value_dim != head_dim or (rotary_dim != head_dim and not partial_rotary):
            raise ValueError(
                f"GGUF has key/value/rotary sizes {head_dim}/{value_dim}/{rotary_dim}; "
                "only models with one head size and full rotary embeddings are supported"
            )
        return cls(
            architecture=architecture,
            vocab_size=meta.vocab_size(),
            hidden_size=hidden,
            # All-sparse models have no dense MLP; some files lack the key then.
            intermediate_size=int(meta.get(f"{arch}.feed_forward_length",
                                           moe.intermediate_size if moe else _REQUIRED)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=meta.uniform_int(f"{arch}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=meta.rope_scaling(),
            max_position_embeddings=int(meta.get(f"{arch}.context_length")),
            tie_word_embeddings=not meta.has_tensor("output.weight"),
            attention_bias=meta.has_tensor(f"blk.{block}.attn_q.bias"),
            qk_norm=meta.has_tensor(f"blk.{block}.attn_q_norm.weight"),
            o_proj_bias=meta.has_tensor(f"blk.{block}.attn_output.bias"),
            moe=moe,
            **hybrid,
            **model_cls.gguf_multimodal(meta),
        )


def _gguf_moe(meta: _GGUFFields, model_cls: type[CausalLM], num_experts: int,
              num_layers: int) -> MoEConfig | None:
    """The MoE facts of a GGUF file with experts, after checking that every
    sparse layer holds its router and experts (stacked, or one per expert as
    old Mixtral files have them)."""
    if num_experts == 0:
        return None
    arch = meta.architecture
    size = meta.get(f"{arch}.expert_feed_forward_length", None)
    if size is None:  # Mixtral files give the expert size as feed_forward_length
        size = meta.get(f"{arch}.feed_forward_length")
    weights_norm = meta.get(f"{arch}.expert_weights_norm", None)
    moe = model_cls.gguf_moe(
        num_experts=num_experts,
        experts_per_token=int(meta.get(f"{arch}.expert_used_count")),
        intermediate_size=int(size),
        weights_norm=None if weights_norm is None else bool(weights_norm),
        num_layers=num_layers,
    )
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
    if shared:  # qwen2moe: one always-on expert beside the routed ones
        moe = dataclasses.replace(moe, shared_expert_intermediate_size=shared)
    for layer in moe.sparse_layers:
        missing = _missing_expert_tensors(meta, layer, num_experts, shared > 0)
        if missing:
            raise ValueError(
                f"GGUF layer {layer} lacks its experts ({', '.join(missing)}); a {arch} "
                f"file with {arch}.expert_count = {num_experts} must have them in every layer"
            )
    return moe


def _missing_expert_tensors(meta: _GGUFFields, layer: int, num_experts: int,
                            shared_expert: bool = False) -> list[str]:
    """The router, and each matrix stacked (ffn_gate_exps) or, in old Mixtral
    files, one per expert (ffn_gate.E); the stacked name stands for both.
    shared_expert: also the shared expert's matrices and gate (ffn_*_shexp)."""
    router = f"blk.{layer}.ffn_gate_inp.weight"
    missing = [] if meta.has_tensor(router) else [router]
    if shared_expert:
        missing += [name for kind in ("gate_inp", "gate", "up", "down")
                    if not meta.has_tensor(name := f"blk.{layer}.ffn_{kind}_shexp.weight")]
    for matrix in ("gate", "up", "down"):
        stacked = f"blk.{layer}.ffn_{matrix}_exps.weight"
        per_expert = all(meta.has_tensor(f"blk.{layer}.ffn_{matrix}.{expert}.weight")
                         for expert in range(num_experts))
        if not meta.has_tensor(stacked) and not per_expert:
            missing.append(stacked)
    return missing


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5 "rope_parameters" or 4's rope_theta/rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        params = {**params, **cfg["rope_scaling"]}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    # Qwen2.5-VL's original config.json says {"type": "mrope", "mrope_section":
    # ...}: plain frequencies, split among position axes (hf_multimodal reads them).
    if rope_type in ("default", "mrope"):
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in _NOT_SCALING_KEYS}
    scaling["rope_type"] = rope_type
    return theta, scaling


# rope_parameters keys that are no frequency scaling: theta, partial rotary,
# and the multimodal RoPE layout.
_NOT_SCALING_KEYS = ("rope_theta", "type", "partial_rotary_factor", "mrope_section",
                     "mrope_interleaved")


def hf_mrope_section(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """The multimodal RoPE sections of rope_parameters (transformers 5) or
    rope_scaling (older config.json files); None where neither names them."""
    for key in ("rope_parameters", "rope_scaling"):
        section = (cfg.get(key) or {}).get("mrope_section")
        if section:
            return tuple(int(n) for n in section)
    return None


def hf_partial_rotary_factor(cfg: dict[str, Any], default: float = 1.0) -> float:
    """The share of each head's dims that RoPE rotates (transformers 5 keeps
    it in rope_parameters, released checkpoints at the top level)."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))


def _hf_context_length(cfg: dict[str, Any]) -> int:
    context = int(cfg.get("max_position_embeddings", 2048))
    # Sliding-window attention is not implemented; within one window it equals
    # full attention, so such models (Mistral v0.1) are served up to the window.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window:
        context = min(context, int(window))
    return context


_REQUIRED = object()


class _GGUFFields:
    """Typed access to a GGUF file's metadata, with errors that name the key."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        self._metadata = gguf_file.metadata
        self._tensors = {tensor.name: tensor for tensor in gguf_file.tensors}
        self.architecture = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._metadata.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(
                    f"GGUF metadata lacks {key!r}; the file is incomplete or not a language model"
                )
            return default
        return value

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def uniform_int(self, key: str, default: int) -> int:
        # Some converters write per-layer lists (e.g. KV heads); we need one value.
        value = self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(
                    f"GGUF {key} varies per layer ({sorted(set(value))}); not supported"
                )
            value = value[0]
        return int(value)

    def vocab_size(self) -> int:
        size = self.get(f"{self.architecture}.vocab_size", None)
        if size is not None:
            return int(size)
        embedding = self._tensors.get("token_embd.weight")
        if embedding is not None:
            return int(embedding.shape[-1])  # GGML dims are reversed: (hidden, vocab)
        raise ValueError("GGUF has neither a vocab_size entry nor a token_embd.weight tensor")

    def rope_scaling(self) -> dict | None:
        arch = self.architecture
        kind = self.get(f"{arch}.rope.scaling.type", "none")
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.get(f"{arch}.rope.scaling.factor"))}
        if kind != "none":
            raise ValueError(
                f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear)"
            )
        # llama.cpp's converter bakes Llama 3.1 rope scaling into per-frequency divisors.
        freqs = self._tensors.get("rope_freqs.weight")
        if freqs is not None:
            factors = dequantize(freqs.data, freqs.tensor_type).ravel()
            return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
        return None
