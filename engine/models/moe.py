"""The mixture-of-experts MLP: a swap for the dense MLP in the layers a config makes sparse.

A router (a linear layer, [E, H]) scores the experts per token, the top k are
picked from the softmax of those scores, and the token's output is the
weighted sum of its experts' SwiGLU MLPs. The experts of a layer are stored
stacked, gate_up [E, 2 * I, H] and down [E, H, I], so a grouped GEMM can read
them as one tensor. Hugging Face checkpoints name each expert's matrices
separately and the loader fills row slices of the stacks (weight_destinations);
llama.cpp's GGUF files already stack them, one [E, rows, cols] tensor per
matrix, and land in one copy each (stacked_weight_destinations).

A host-resident layer (--expert-residency host, --n-cpu-moe) allocates its two
expert stacks in page-locked host memory from the start, so the device never
holds them; the router and everything outside the block stay on the device,
and the GPU reads the selected experts from host memory. On the CPU device
that changes nothing but the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.execution.model_ops import ReferenceOps
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.execution.expert_cache import LayerCache


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


# The SparseMoE parameters that a host-resident layer keeps in host memory.
HOST_RESIDENT_WEIGHTS = ("gate_up_weight", "down_weight")


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, names: ExpertTensorNames,
                 device: torch.device | str, dtype: torch.dtype,
                 host_resident: bool = False) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, "a sparse layer needs the config's MoE facts"
        self.moe = moe
        self.names = names
        self.checkpoint_name = names.block
        # The expert stacks live in host memory (page-locked when the device
        # is a GPU); device_state's sleep and the memory ledger read this.
        self.host_resident = host_resident
        self.host_weight_names = HOST_RESIDENT_WEIGHTS if host_resident else ()
        # Device copies of this host-resident layer's most used experts, set
        # by the model runner (engine/execution/expert_cache.py) on a GPU.
        self.expert_cache: LayerCache | None = None
        hidden, size = config.hidden_size, moe.intermediate_size

        def empty(*shape: int, on_host: bool = False) -> nn.Parameter:
            if on_host and torch.device(device).type == "cuda":
                data = torch.empty(shape, device="cpu", dtype=dtype, pin_memory=True)
            else:
                data = torch.empty(shape, device=device, dtype=dtype)
            return nn.Parameter(data, requires_grad=False)

        self.router_weight = empty(moe.num_experts, hidden)
        self.gate_up_weight = empty(moe.num_experts, 2 * size, hidden, on_host=host_resident)
        self.down_weight = empty(moe.num_experts, hidden, size, on_host=host_resident)

    def forward(self, hidden: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        logits = ops.linear(hidden, self.router_weight)
        weights, experts = ops.moe_route(logits, self.moe.experts_per_token,
                                         self.moe.normalize_topk)
        if not self.moe.weigh_in_float32:
            weights = weights.to(hidden.dtype)
        cache = self.expert_cache
        if cache is None:
            return ops.moe_experts(hidden, self.gate_up_weight, self.down_weight, experts, weights)
        cache.count(experts)
        return ops.moe_experts(hidden, self.gate_up_weight, self.down_weight, experts, weights,
                               cache=cache.view)

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        size, names = self.moe.intermediate_size, self.names
        dests = {f"{prefix}.{names.router}.weight": self.router_weight}
        for expert in range(self.moe.num_experts):
            at = f"{prefix}.experts.{expert}"
            dests[f"{at}.{names.gate}.weight"] = self.gate_up_weight[expert, :size]
            dests[f"{at}.{names.up}.weight"] = self.gate_up_weight[expert, size:]
            dests[f"{at}.{names.down}.weight"] = self.down_weight[expert]
        return dests

    def stacked_weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        """Slots for checkpoints holding all experts of a matrix in one tensor,
        named {prefix}.experts.<matrix>.weight (as llama.cpp's converter names
        them before mapping to ffn_*_exps)."""
        size, names = self.moe.intermediate_size, self.names
        return {
            f"{prefix}.{names.router}.weight": self.router_weight,
            f"{prefix}.experts.{names.gate}.weight": self.gate_up_weight[:, :size],
            f"{prefix}.experts.{names.up}.weight": self.gate_up_weight[:, size:],
            f"{prefix}.experts.{names.down}.weight": self.down_weight,
        }
