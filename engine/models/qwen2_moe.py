"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases)
with, in the sparse layers, routed experts plus one always-on shared expert.

The sparse block is SharedExpertMoE: the routed experts' weighted sum plus
sigmoid(shared_expert_gate(x)) * shared_expert(x), the shared expert a SwiGLU
MLP of shared_expert_intermediate_size. Layers are chosen as in Qwen3-MoE
(decoder_sparse_step, mlp_only_layers); the routing weights are cast to the
model dtype, and renormalised only when norm_topk_prob says so (released
Qwen2-MoE checkpoints do not). llama.cpp's qwen2moe GGUFs make every layer
sparse, stack the experts (ffn_*_exps) and name the shared expert ffn_*_shexp,
its gate ffn_gate_inp_shexp.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.config import ModelConfig, MoEConfig
from engine.models.decoder import MLP, AttentionTraits, experts_on_host
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3_moe import hf_qwen_moe
from engine.models.shared_expert_moe import SharedExpertMoE


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    gguf_architecture = "qwen2moe"
    gguf_has_experts = True

    @classmethod
    def hf_traits(cls, cfg: dict[str, Any]) -> AttentionTraits:
        return AttentionTraits(qkv_bias=bool(cfg.get("qkv_bias", True)), o_proj_bias=False,
                               qk_norm=False)

    @classmethod
    def hf_moe(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        return hf_qwen_moe(cfg, int(cfg["shared_expert_intermediate_size"]))

    @classmethod
    def gguf_moe(cls, num_experts: int, experts_per_token: int, intermediate_size: int,
                 weights_norm: bool | None, num_layers: int) -> MoEConfig:
        # llama.cpp's qwen2moe graph does not renormalise (nor does the
        # converter write expert_weights_norm); a file that says so is obeyed.
        # The shared expert's size is read by ModelConfig.from_gguf.
        return MoEConfig(
            num_experts=num_experts,
            experts_per_token=experts_per_token,
            intermediate_size=intermediate_size,
            normalize_topk=bool(weights_norm),
            sparse_layers=tuple(range(num_layers)),
        )

    def _mlp(self, config: ModelConfig, layer: int, device: torch.device | str,
             dtype: torch.dtype) -> MLP | SharedExpertMoE:  # type: ignore[override]
        if config.moe is None or not config.moe.is_sparse(layer):
            return MLP(config, device, dtype)
        if config.moe.shared_expert_intermediate_size == 0:
            # transformers always builds the shared expert; a GGUF must size it.
            raise ValueError("Qwen2-MoE needs its shared expert's size "
                             "(qwen2moe.expert_shared_feed_forward_length in a GGUF)")
        return SharedExpertMoE(config, self.expert_tensor_names, device, dtype,
                               host_resident=experts_on_host(layer, self.host_expert_layers))
