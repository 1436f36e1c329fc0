"""The mixture-of-experts MLP: a swap for the dense MLP in the layers a config makes sparse.

A router (a linear layer, [E, H]) scores the experts per token, the top k are
picked from the softmax of those scores, and the token's output is the
weighted sum of its experts' SwiGLU MLPs. The experts of a layer are stored
stacked, gate_up [E, 2 * I, H] and down [E, H, I], so a grouped GEMM can read
them as one tensor; checkpoints name each expert's matrices separately and the
loader fills row slices of the stacks (weight_destinations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.execution.model_ops import ReferenceOps
from engine.models.config import ModelConfig
from kernels.moe_reference import route_topk


@dataclass(frozen=True)
class ExpertTensorNames:
    """How a checkpoint names a sparse MLP's tensors, under model.layers.N."""

    block: str  # the MLP's module name in a layer
    router: str  # the router's linear layer, under block
    gate: str  # one expert's matrices, under block.experts.E
    up: str
    down: str


QWEN_EXPERT_NAMES = ExpertTensorNames("mlp", "gate", "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ExpertTensorNames("block_sparse_moe", "gate", "w1", "w3", "w2")


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, names: ExpertTensorNames,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, "a sparse layer needs the config's MoE facts"
        self.moe = moe
        self.names = names
        self.checkpoint_name = names.block
        hidden, size = config.hidden_size, moe.intermediate_size

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, device=device, dtype=dtype),
                                requires_grad=False)

        self.router_weight = empty(moe.num_experts, hidden)
        self.gate_up_weight = empty(moe.num_experts, 2 * size, hidden)
        self.down_weight = empty(moe.num_experts, hidden, size)

    def forward(self, hidden: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        logits = ops.linear(hidden, self.router_weight)
        weights, experts = route_topk(logits, self.moe.experts_per_token, self.moe.normalize_topk)
        if not self.moe.weigh_in_float32:
            weights = weights.to(hidden.dtype)
        return ops.moe_experts(hidden, self.gate_up_weight, self.down_weight, experts, weights)

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        size, names = self.moe.intermediate_size, self.names
        dests = {f"{prefix}.{names.router}.weight": self.router_weight}
        for expert in range(self.moe.num_experts):
            at = f"{prefix}.experts.{expert}"
            dests[f"{at}.{names.gate}.weight"] = self.gate_up_weight[expert, :size]
            dests[f"{at}.{names.up}.weight"] = self.gate_up_weight[expert, size:]
            dests[f"{at}.{names.down}.weight"] = self.down_weight[expert]
        return dests
