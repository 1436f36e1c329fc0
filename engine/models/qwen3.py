"""Qwen3 dense: per-head RMSNorm of q and k before RoPE, no biases by default."""

from __future__ import annotations

from typing import Any

from engine.models.decoder import AttentionTraits, CausalLM


class Qwen3ForCausalLM(CausalLM):
    gguf_architecture = "qwen3"

    @classmethod
    def hf_traits(cls, cfg: dict[str, Any]) -> AttentionTraits:
        bias = bool(cfg.get("attention_bias", False))
        return AttentionTraits(qkv_bias=bias, o_proj_bias=bias, qk_norm=True)
