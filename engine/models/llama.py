"""Llama family: Llama 2/3.x (llama3 rope scaling), SmolLM2, Mistral (no sliding window)."""

from __future__ import annotations

from typing import Any

from engine.models.decoder import AttentionTraits, CausalLM


class LlamaForCausalLM(CausalLM):
    gguf_architecture = "llama"
    # convert_hf_to_gguf.py reorders q/k rows from rotate_half pairs to
    # interleaved pairs (llama.cpp's original RoPE layout); the loader undoes it.
    gguf_permuted_qk = True

    @classmethod
    def hf_traits(cls, cfg: dict[str, Any]) -> AttentionTraits:
        if cfg.get("mlp_bias"):
            raise ValueError("Llama checkpoints with mlp_bias=true are not supported")
        bias = bool(cfg.get("attention_bias", False))
        return AttentionTraits(qkv_bias=bias, o_proj_bias=bias, qk_norm=False)


class MistralForCausalLM(LlamaForCausalLM):
    """Same math as Llama. Sliding windows are handled in ModelConfig by capping
    the context at the window, where full attention is exact."""

    # llama.cpp stores Mistral GGUFs under general.architecture "llama".
    gguf_architecture = None
