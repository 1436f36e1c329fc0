"""Mixture-of-experts decode on the GPU: top-k routing and an expert GEMV that
reads only the selected experts' weights (kernels/csrc/moe.cu); references:
kernels.moe_reference.route_topk and moe_experts.

At decode batch sizes the expert MLP is memory-bound, and a token touches k of
E experts: streaming just those rows makes a batch-1 step cost the active
parameters, not the total. Both ops are CUDA-graph safe when their outputs
(and the GEMV's workspace) are given: nothing is allocated, nothing syncs
with the host, and the launch grids depend only on the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.cuda_build import (
    check_cuda_tensor,
    device_index_of,
    launch,
    load_kernel,
    ptr,
    tensors_overlap,
)

_SOURCE = "moe.cu"
MAX_EXPERTS = 512  # moe_route: 16 experts per lane of a warp
MAX_TOP_K = 16
_VECTOR = 8  # bf16 per 16-byte load: H and I must be multiples of it
_ROUTE_WARPS = 4  # tokens per routing CTA
_GATE_UP_ROWS = 4  # I rows per gate/up CTA (one warp each)
_DOWN_ROWS = 4  # H rows per down CTA
_DOWN_THREADS = 256
_MAX_INDEX = 2**31 - 1
_MAX_GRID_Y = 65535


def _check_aligned(name: str, tensor: torch.Tensor) -> None:
    # The kernels read rows of bf16 in 16-byte vectors; rows are multiples of
    # 16 bytes long, so an aligned start aligns every row.
    if tensor.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address")


def _check_output(name: str, tensor: torch.Tensor, dtype: torch.dtype,
                  shape: tuple[int, ...], device: torch.device) -> None:
    check_cuda_tensor(name, tensor, dtype=dtype, ndim=len(shape), device=device)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must be {shape}, got {tuple(tensor.shape)}")


def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    *,
    weights_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits bf16 or float32 [T, E], E <= 512 -> (weights float32
    [T, k], expert ids int32 [T, k]), 1 <= k <= min(E, 16).

    Softmax over all E in float32 (max subtracted, expf, IEEE division, no
    fast math), then the k largest probabilities in descending order; equal
    probabilities go to the lower expert first. (torch.topk, which route_topk
    and transformers' routers call, documents no order among equal values; on
    the CPU it returns an all-zero row's top 8 as e.g. [84, 87, 86, ...].)
    With normalize, the k weights are divided by their sum (summed
    in slot order). A NaN probability ranks as zero. Differs from
    route_topk only in the float32 rounding of the softmax sums (a few ulp),
    and in which of exactly equal probabilities come first.
    """
    check_cuda_tensor("router_logits", router_logits, dtype=router_logits.dtype, ndim=2)
    if router_logits.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"router_logits must be bfloat16 or float32, got {router_logits.dtype}")
    tokens, num_experts = router_logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"router_logits must have 1 to {MAX_EXPERTS} experts, got {num_experts}")
    if not 1 <= top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(f"top_k must be 1 to min(E={num_experts}, {MAX_TOP_K}), got {top_k}")
    device = router_logits.device
    if weights_out is None:
        weights_out = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    else:
        _check_output("weights_out", weights_out, torch.float32, (tokens, top_k), device)
    if ids_out is None:
        ids_out = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
    else:
        _check_output("ids_out", ids_out, torch.int32, (tokens, top_k), device)
    if tensors_overlap(weights_out, ids_out) or tensors_overlap(weights_out, router_logits) \
            or tensors_overlap(ids_out, router_logits):
        raise ValueError("weights_out, ids_out and router_logits must not overlap")
    if tokens == 0:
        return weights_out, ids_out
    name = "moe_route_bf16" if router_logits.dtype == torch.bfloat16 else "moe_route_f32"
    kernel = load_kernel(_SOURCE, name, device_index_of(router_logits))
    blocks = -(-tokens // _ROUTE_WARPS)
    args = (ptr(weights_out), ptr(ids_out), ptr(router_logits), np.int32(tokens),
            np.int32(num_experts), np.int32(top_k), np.int32(1 if normalize else 0))
    launch(kernel, (blocks,), (32 * _ROUTE_WARPS,), args, device)
    return weights_out, ids_out


def moe_gemv_workspace(max_pairs: int, intermediate_size: int,
                       device: torch.device | str) -> torch.Tensor:
    """The activation buffer moe_experts_gemv needs: bf16 [max_pairs, I], one
    row per (token, slot) pair; max_pairs = the most tokens times top_k.
    Allocate once (before capturing graphs) and pass it to every call."""
    return torch.empty((max_pairs, intermediate_size), dtype=torch.bfloat16, device=device)


@dataclass(frozen=True)
class ExpertCacheView:
    """A layer's device cache of experts: slots int32 [E] (the slot holding
    each expert, -1 for none), gate_up [S, 2I, H] and down [S, H, I] bf16."""

    slots: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _check_expert_stack(name: str, stack: torch.Tensor, device: torch.device) -> None:
    """A stack of experts on the device, or in page-locked host memory (host-
    resident experts): with unified addressing a pinned buffer's address is
    valid on the GPU, which then reads the selected experts over the bus."""
    if stack.is_cuda or not stack.is_pinned():
        check_cuda_tensor(name, stack, dtype=torch.bfloat16, ndim=3, device=device)
        return
    if stack.dtype != torch.bfloat16 or stack.dim() != 3 or not stack.is_contiguous():
        raise ValueError(f"{name} in host memory must be a contiguous bf16 [E, rows, cols] "
                         f"stack, got {stack.dtype} {tuple(stack.shape)}")


def moe_experts_gemv(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    cache: ExpertCacheView | None = None,
) -> torch.Tensor:
    """Each token through its k selected SwiGLU experts, weighted and summed.

    hidden bf16 [T, H]; gate_up bf16 [E, 2I, H] (the gate's I rows first);
    down bf16 [E, H, I] (both on the device or both in page-locked host
    memory, read over the bus); ids int32 [T, k], 1 <= k <= 16; weights float32
    [T, k]. H and I multiples of 8; every tensor contiguous, the bf16 ones
    16-byte aligned. Returns (or fills) out bf16 [T, H]; workspace is bf16
    [>= T * k, I] (moe_gemv_workspace), allocated here when not given.

    Numerics, per (token t, slot j) with e = ids[t, j]: g, u = the float32
    dot products of gate_up[e]'s rows with hidden[t], each rounded to bf16
    (as F.linear's output is); act = bf16(bf16(silu(g)) * u), as
    kernels.activation.silu_and_mul; y = bf16(float32 dot of down[e]'s rows
    with act); c_j = bf16(y * weights[t, j]) (the float32 product rounded, as
    the reference's `(y * w).to(bf16)`); out[t] = bf16(c_0 + c_1 + ...)
    summed in float32 in slot order. The reference adds the c_j in bf16, in
    expert order, so the two differ by bf16 rounding of the sum. Dot products
    are per-lane fma chains reduced by a fixed butterfly: deterministic.
    An id outside [0, E) contributes zero and reads no weights.

    cache: device copies of some experts (host-resident stacks keep their
    hot experts there, engine/execution/expert_cache.py): an expert whose
    cache.slots entry is s >= 0 is read from cache.gate_up[s] / cache.down[s]
    (the same values, in device memory) instead of the stacks.
    """
    check_cuda_tensor("hidden", hidden, dtype=torch.bfloat16, ndim=2)
    device = hidden.device
    _check_expert_stack("gate_up", gate_up, device)
    _check_expert_stack("down", down, device)
    check_cuda_tensor("ids", ids, dtype=torch.int32, ndim=2, device=device)
    check_cuda_tensor("weights", weights, dtype=torch.float32, ndim=2, device=device)
    tokens, hidden_size = hidden.shape
    num_experts, twice_intermediate, gate_up_h = gate_up.shape
    intermediate = twice_intermediate // 2
    top_k = ids.shape[1]
    if hidden_size < _VECTOR or hidden_size % _VECTOR:
        raise ValueError(f"H must be a positive multiple of {_VECTOR}, got {hidden_size}")
    if twice_intermediate % 2 or intermediate < _VECTOR or intermediate % _VECTOR:
        raise ValueError(f"gate_up must be [E, 2I, H] with I a positive multiple of {_VECTOR}, "
                         f"got {tuple(gate_up.shape)}")
    if gate_up_h != hidden_size or num_experts < 1:
        raise ValueError(f"gate_up must be [E, 2I, {hidden_size}], got {tuple(gate_up.shape)}")
    if tuple(down.shape) != (num_experts, hidden_size, intermediate):
        raise ValueError(f"down must be {(num_experts, hidden_size, intermediate)}, "
                         f"got {tuple(down.shape)}")
    if ids.shape[0] != tokens or not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"ids must be [{tokens}, k] with 1 <= k <= {MAX_TOP_K}, "
                         f"got {tuple(ids.shape)}")
    if tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights must be {tuple(ids.shape)} like ids, got {tuple(weights.shape)}")
    if cache is not None:
        _check_cache(cache, num_experts, gate_up, down, device)
    pairs = tokens * top_k
    # Pair numbers and the pair grid are int32 in the kernels: stay far from overflow.
    if pairs * max(intermediate, hidden_size) > _MAX_INDEX:
        raise ValueError(f"too many tokens for one call: {tokens} x k={top_k}")
    # Row tiles are the grid's y dimension (at most 65535 blocks).
    if max(intermediate, hidden_size) > _MAX_GRID_Y * _GATE_UP_ROWS:
        raise ValueError(f"H and I must be at most {_MAX_GRID_Y * _GATE_UP_ROWS}")
    for name, tensor in (("hidden", hidden), ("gate_up", gate_up), ("down", down)):
        _check_aligned(name, tensor)
    inputs = {"hidden": hidden, "gate_up": gate_up, "down": down, "ids": ids, "weights": weights}
    if workspace is None:
        workspace = moe_gemv_workspace(max(pairs, 1), intermediate, device)
    else:
        check_cuda_tensor("workspace", workspace, dtype=torch.bfloat16, ndim=2, device=device)
        if workspace.shape[0] < pairs or workspace.shape[1] != intermediate:
            raise ValueError(f"workspace must be [>= {pairs}, {intermediate}], "
                             f"got {tuple(workspace.shape)}")
        _check_aligned("workspace", workspace)
        for name, tensor in inputs.items():
            if tensors_overlap(workspace, tensor):
                raise ValueError(f"workspace must not overlap {name}")
    if out is None:
        out = torch.empty((tokens, hidden_size), dtype=torch.bfloat16, device=device)
    else:
        _check_output("out", out, torch.bfloat16, (tokens, hidden_size), device)
        for name, tensor in (*inputs.items(), ("workspace", workspace)):
            if tensors_overlap(out, tensor):
                raise ValueError(f"out must not overlap {name}")
    if tokens == 0:
        return out

    index = device_index_of(hidden)
    gate_up_kernel = load_kernel(_SOURCE, "moe_gate_up_silu", index)
    down_kernel = load_kernel(_SOURCE, "moe_down_sum", index)
    shape_args = (np.int32(top_k), np.int32(num_experts), np.int32(hidden_size),
                  np.int32(intermediate))
    null = np.uint64(0)
    slots, cache_gate_up, cache_down = ((ptr(cache.slots), ptr(cache.gate_up), ptr(cache.down))
                                        if cache is not None else (null, null, null))
    launch(gate_up_kernel, (pairs, -(-intermediate // _GATE_UP_ROWS)), (32 * _GATE_UP_ROWS,),
           (ptr(workspace), ptr(hidden), ptr(gate_up), ptr(ids), slots, cache_gate_up,
            *shape_args), device)
    launch(down_kernel, (tokens, -(-hidden_size // _DOWN_ROWS)), (_DOWN_THREADS,),
           (ptr(out), ptr(workspace), ptr(down), ptr(ids), ptr(weights), slots, cache_down,
            *shape_args), device)
    return out


def _check_cache(cache: ExpertCacheView, num_experts: int, gate_up: torch.Tensor,
                 down: torch.Tensor, device: torch.device) -> None:
    check_cuda_tensor("cache.slots", cache.slots, dtype=torch.int32, ndim=1, device=device)
    check_cuda_tensor("cache.gate_up", cache.gate_up, dtype=torch.bfloat16, ndim=3, device=device)
    check_cuda_tensor("cache.down", cache.down, dtype=torch.bfloat16, ndim=3, device=device)
    if cache.slots.shape[0] != num_experts:
        raise ValueError(f"cache.slots must have one entry per expert ({num_experts}), "
                         f"got {tuple(cache.slots.shape)}")
    if cache.gate_up.shape[1:] != gate_up.shape[1:] or cache.down.shape[1:] != down.shape[1:] \
            or cache.gate_up.shape[0] != cache.down.shape[0]:
        raise ValueError(f"cache stacks {tuple(cache.gate_up.shape)} / {tuple(cache.down.shape)} "
                         f"do not hold experts of {tuple(gate_up.shape[1:])} / "
                         f"{tuple(down.shape[1:])}")
    _check_aligned("cache.gate_up", cache.gate_up)
    _check_aligned("cache.down", cache.down)
