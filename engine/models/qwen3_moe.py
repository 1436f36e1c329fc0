"""Qwen3-MoE: Qwen3's attention with a mixture-of-experts MLP in the sparse layers.

A layer is sparse unless it is listed in mlp_only_layers, when the model has
experts and (layer + 1) is a multiple of decoder_sparse_step; the other layers
keep a dense MLP of intermediate_size, as transformers builds them.
llama.cpp's qwen3moe GGUFs make every layer sparse and stack the experts per
matrix (ffn_*_exps, expert_feed_forward_length rows).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import MoEConfig
from engine.models.qwen3 import Qwen3ForCausalLM


def hf_qwen_moe(cfg: dict[str, Any], shared_expert_size: int = 0) -> MoEConfig | None:
    """The MoE facts of a Qwen2-/Qwen3-MoE config.json (None: no experts),
    with a shared expert of shared_expert_size (0: none)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"experts with activation {cfg['hidden_act']!r} are not supported "
                         "(only silu)")
    # transformers 5 writes num_local_experts; released checkpoints say num_experts.
    num_experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
    if num_experts == 0:
        return None
    return MoEConfig(
        num_experts=num_experts,
        experts_per_token=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        normalize_topk=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=hf_sparse_layers(cfg),
        shared_expert_intermediate_size=shared_expert_size,
    )


def hf_sparse_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The layers that transformers' Qwen2-/Qwen3-MoE make sparse: those not in
    mlp_only_layers whose (layer + 1) is a multiple of decoder_sparse_step."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    return tuple(layer for layer in range(int(cfg["num_hidden_layers"]))
                 if layer not in dense_only and (layer + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    gguf_architecture = "qwen3moe"
    gguf_has_experts = True

    @classmethod
    def hf_moe(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError(
                "Qwen3-MoE checkpoints with shared experts (shared_expert_intermediate_size) "
                "are not supported"
            )
        return hf_qwen_moe(cfg)

    @classmethod
    def gguf_moe(cls, num_experts: int, experts_per_token: int, intermediate_size: int,
                 weights_norm: bool | None, num_layers: int) -> MoEConfig:
        # convert_hf_to_gguf.py writes no norm_topk_prob for qwen3moe and
        # llama.cpp's qwen3moe graph always renormalises (as every released
        # Qwen3-MoE's config does); a file that says otherwise is obeyed.
        return MoEConfig(
            num_experts=num_experts,
            experts_per_token=experts_per_token,
            intermediate_size=intermediate_size,
            normalize_topk=True if weights_norm is None else weights_norm,
            sparse_layers=tuple(range(num_layers)),
        )
