"""Mixtral: Llama/Mistral attention with a mixture-of-experts MLP in every layer.

Top-k (2 in the released models) of the softmax over the router logits,
renormalised; experts w1 (gate), w3 (up), w2 (down) of intermediate_size,
under block_sparse_moe. Sliding windows are capped as for Mistral
(ModelConfig's context length). llama.cpp writes Mixtral GGUFs as "llama"
files with llama.expert_count, q/k rows permuted as for Llama, and the
experts stacked per matrix (ffn_*_exps; per expert, ffn_gate.E, in old files).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import MoEConfig
from engine.models.decoder import CausalLM
from engine.models.moe import MIXTRAL_EXPERT_NAMES


class MixtralForCausalLM(CausalLM):
    gguf_architecture = "llama"
    gguf_has_experts = True
    gguf_permuted_qk = True
    expert_tensor_names = MIXTRAL_EXPERT_NAMES

    @classmethod
    def hf_moe(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"experts with activation {cfg['hidden_act']!r} are not supported "
                             "(only silu)")
        return MoEConfig(
            num_experts=int(cfg["num_local_experts"]),
            experts_per_token=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["intermediate_size"]),
            normalize_topk=True,
            sparse_layers=tuple(range(int(cfg["num_hidden_layers"]))),
            weigh_in_float32=True,
        )

    @classmethod
    def gguf_moe(cls, num_experts: int, experts_per_token: int, intermediate_size: int,
                 weights_norm: bool | None, num_layers: int) -> MoEConfig:
        # llama.cpp's llama graph always renormalises the top-k weights.
        return MoEConfig(
            num_experts=num_experts,
            experts_per_token=experts_per_token,
            intermediate_size=intermediate_size,
            normalize_topk=True,
            sparse_layers=tuple(range(num_layers)),
            weigh_in_float32=True,
        )
