"""A mixture-of-experts block with a shared expert (Qwen2-MoE, Qwen3-Next).

Beside the routed experts (engine/models/moe.py's SparseMoE), every token
also goes through one dense SwiGLU MLP, the shared expert, whose output is
scaled by sigmoid(shared_expert_gate(x)), a per-token scalar, and added.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.execution.model_ops import ReferenceOps
from engine.models.config import ModelConfig
from engine.models.decoder import MLP
from engine.models.moe import ExpertTensorNames, SparseMoE


class SharedExpertMoE(nn.Module):
    """Routed experts plus sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    def __init__(self, config: ModelConfig, names: ExpertTensorNames,
                 device: torch.device | str, dtype: torch.dtype,
                 host_resident: bool = False) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None and moe.shared_expert_intermediate_size > 0
        self.checkpoint_name = names.block
        self.routed = SparseMoE(config, names, device, dtype, host_resident=host_resident)
        shared_config = dataclasses.replace(
            config, intermediate_size=moe.shared_expert_intermediate_size)
        self.shared_expert = MLP(shared_config, device, dtype)
        self.shared_gate_weight = nn.Parameter(
            torch.empty((1, config.hidden_size), device=device, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        gate_logit = ops.linear(hidden, self.shared_gate_weight)
        return ops.shared_expert_combine(self.routed(hidden, ops),
                                         self.shared_expert(hidden, ops), gate_logit)

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            **self.routed.weight_destinations(prefix),
            **self._shared_destinations(prefix),
        }

    def stacked_weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        """As weight_destinations, with the routed experts stacked per matrix
        (SparseMoE.stacked_weight_destinations: GGUF's ffn_*_exps)."""
        return {
            **self.routed.stacked_weight_destinations(prefix),
            **self._shared_destinations(prefix),
        }

    def _shared_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            **self.shared_expert.weight_destinations(f"{prefix}.shared_expert"),
            f"{prefix}.shared_expert_gate.weight": self.shared_gate_weight,
        }
