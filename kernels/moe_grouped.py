"""Mixture-of-experts experts as two grouped GEMMs, for prefill chunks and large batches.

The (token, slot) pairs are sorted by expert on the device, so each expert's
rows are one contiguous block and `torch._grouped_mm` multiplies every block by
its expert's matrices in one launch: each selected expert's weights are read
once for all its tokens, on tensor cores. Nothing reads the routing back to the
host and every shape depends only on T, k, H, I and E, so a CUDA graph can
capture it (unlike kernels/moe_reference.moe_experts, which loops over experts
on the host).

Constraints of torch._grouped_mm (read in torch's GroupedBlas.cpp and
GroupMM.cu; the CPU ones checked on 2.13), as this module meets them:
- a [M, K] and b [G, K, N] must each be row- or column-major in their last two
  dims, the other stride a multiple of 16 bytes, the data pointer 16-byte
  aligned. a is the freshly gathered (contiguous) rows; b is the stored stack
  transposed, gate_up.transpose(1, 2) [E, H, 2I] and down.transpose(1, 2)
  [E, I, H]: column-major, i.e. K-major, the layout cuBLAS reads for F.linear
  and one the CUTLASS kernel is built for (it takes all four row/column-major
  combinations), so the model's stacks need no other stored layout and no
  copy per call. Hence H and I must be
  multiples of 16 bytes' worth of elements (8 for bf16, 4 for float32).
- offs: int32, 1-D, one cumulative row end per group (len E); empty groups
  are fine; offs[-1] must equal M (rows past it are left unwritten).
- the output dtype equals a's: no float32 output from bf16 inputs.
- on CUDA, E < 1024 (torch checks it: its per-group setup is one block of
  one thread per group).
- on CUDA only bf16 on sm90/sm100 takes the CUTLASS kernel that keeps offs on
  the device; any other dtype or GPU falls back to a per-group loop that copies
  offs to the host (correct, but neither fast nor capturable). On the CPU it
  works for float32 and bf16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import reference

_ALIGN_BYTES = 16


def _check_layout(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  experts: torch.Tensor, weights: torch.Tensor) -> None:
    tokens, hidden_size = hidden.shape
    num_experts, double_size, _ = gate_up.shape
    size = double_size // 2
    if gate_up.shape != (num_experts, 2 * size, hidden_size) or \
            down.shape != (num_experts, hidden_size, size):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} "
                         f"do not stack [E, 2I, {hidden_size}] and [E, {hidden_size}, I]")
    if experts.dtype != torch.int64 or experts.ndim != 2 or experts.shape[0] != tokens \
            or weights.shape != experts.shape:
        raise ValueError(f"experts must be int64 [{tokens}, k] and weights the same shape, got "
                         f"{experts.dtype} {tuple(experts.shape)} and {tuple(weights.shape)}")
    # The transposed stacks are K-major views: their row strides are H and I.
    align = _ALIGN_BYTES // hidden.element_size()
    if hidden_size % align or size % align:
        raise ValueError(f"H={hidden_size} and I={size} must be multiples of {align} "
                         f"for {hidden.dtype} grouped GEMMs (16-byte strides)")
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("gate_up and down must be contiguous stacks")


def moe_experts_grouped(
    hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    experts: torch.Tensor, weights: torch.Tensor, *,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = reference.silu_and_mul,
) -> torch.Tensor:
    """Each token through its selected experts, summed with its routing weights.

    hidden [T, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I];
    experts int64 [T, k]; weights [T, k] in the dtype the product is taken in
    (the model dtype or float32, as for moe_reference.moe_experts).
    silu_and_mul maps [M, 2I] to [M, I] (kernels.activation.silu_and_mul on
    the GPU). Returns [T, H] in hidden's dtype.

    Numerics against moe_reference.moe_experts: every rounding the reference
    makes up to each (token, slot) contribution happens here too, at the same
    place: the gate_up GEMM, SwiGLU and the down GEMM each round to the model
    dtype (GEMMs accumulate in float32; the grouped kernel may order K
    differently from cuBLAS, so equal only up to the GEMMs' own rounding), and
    the weighted product, taken in the weights' dtype, is rounded to the model
    dtype. They differ in the sum: the reference adds each contribution into
    the model-dtype output in expert order, rounding after every add; here a
    token's k contributions are added in float32 in slot order and rounded once
    (as the decode kernel, kernels/csrc/moe.cu, does). In float32 the two agree
    to float32 rounding; in bf16 this path is the more exact.
    Deterministic: no float atomics (the only scatter-add counts integers).
    """
    _check_layout(hidden, gate_up, down, experts, weights)
    tokens, hidden_size = hidden.shape
    top_k = experts.shape[1]
    num_experts = gate_up.shape[0]
    if tokens == 0:
        return torch.zeros_like(hidden)
    flat_experts = experts.reshape(-1)
    pairs = flat_experts.numel()
    # Stable: an expert's (token, slot) pairs stay in token order, as in the reference.
    order = torch.argsort(flat_experts, stable=True)
    # A device-side histogram: bincount would read its maximum back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=hidden.device)
    counts.scatter_add_(0, flat_experts, torch.ones(pairs, dtype=torch.int32, device=hidden.device))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)

    rows = hidden.index_select(0, order // top_k)
    gate_up_out = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)
    activated = silu_and_mul(gate_up_out)
    down_out = torch._grouped_mm(activated, down.transpose(1, 2), offs=ends)
    # The product in the weights' dtype, rounded to the model dtype: where the
    # reference and the decode kernel (kernels/csrc/moe.cu) round it too.
    pair_weights = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    weighted = (down_out * pair_weights).to(hidden.dtype)

    # Un-permute by a gather (sorted position of each pair), not a scatter-add.
    position = torch.empty_like(order)
    position.scatter_(0, order, torch.arange(pairs, device=order.device))
    per_slot = weighted.index_select(0, position).view(tokens, top_k, hidden_size)
    total = per_slot[:, 0].to(torch.float32, copy=True)
    for slot in range(1, top_k):
        total += per_slot[:, slot]  # float32 += model dtype: widened, then added
    return total.to(hidden.dtype)
