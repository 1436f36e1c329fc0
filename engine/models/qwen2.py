"""Qwen2 / Qwen2.5: Llama blocks with biases on the q/k/v projections (never on o_proj)."""

from __future__ import annotations

from typing import Any

from engine.models.decoder import AttentionTraits, CausalLM


class Qwen2ForCausalLM(CausalLM):
    gguf_architecture = "qwen2"

    @classmethod
    def hf_traits(cls, cfg: dict[str, Any]) -> AttentionTraits:
        # Qwen2's config.json has no attention_bias key: the biases are always there.
        return AttentionTraits(qkv_bias=True, o_proj_bias=False, qk_norm=False)
