"""Torch reference of a mixture-of-experts MLP: top-k routing and SwiGLU experts.

Expert weights are stacked per layer, gate_up [E, 2 * I, H] (gate rows first)
and down [E, H, I], the layout a grouped GEMM reads. These functions are the
CPU path and what the CUDA paths (kernels/moe.py, kernels/moe_grouped.py) are
checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk(router_logits: torch.Tensor, top_k: int,
               normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (float32 weights [T, k], expert ids int64 [T, k]).

    Softmax over all experts in float32, then the k largest; with normalize
    the k weights are divided by their sum. torch.topk breaks ties the way
    transformers' routers do, because they call the same function."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _expert_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def moe_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token through its selected experts, summed with its routing weights.

    hidden [T, H]; experts int64 [T, k]; weights [T, k] in the dtype the
    product is taken in (an architecture's choice: the model dtype or
    float32). Only experts that some token picked are computed, each over its
    own tokens; contributions are added in expert order in the model dtype.
    Reads the routing back to the host, so a CUDA graph cannot capture it
    (the GPU runs kernels/moe.py's GEMV and kernels/moe_grouped.py instead)."""
    out = torch.zeros_like(hidden)
    flat_experts = experts.reshape(-1)
    # Stable sort: an expert's (token, slot) pairs stay in token order.
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=gate_up.shape[0]).tolist()
    top_k = experts.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start:start + count]
        start += count
        tokens = picks // top_k
        contribution = _expert_swiglu(hidden[tokens], gate_up[expert], down[expert])
        contribution = contribution * weights.reshape(-1)[picks, None]
        out.index_add_(0, tokens, contribution.to(hidden.dtype))
    return out
