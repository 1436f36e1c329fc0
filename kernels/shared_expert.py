"""The shared-expert MoE's combine on the GPU: routed + sigmoid(gate) * shared.

One launch where torch takes three (sigmoid, product, sum), each step rounded
to bf16 as torch's ops round it, so the result is torch's bit for bit (up to
expf against torch's exp in float32's last bit, which can flip the sigmoid's
bf16 rounding). Reference: ReferenceOps.shared_expert_combine. CUDA-graph
safe: with `out` given nothing is allocated and nothing syncs.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor, launch, load_kernel, ptr

_SOURCE = "shared_expert.cu"
_THREADS = 256
_VECTOR = 8


def combine_supported(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether the kernel takes these operands (else the caller uses torch)."""
    tensors = (routed, shared, gate)
    return (all(t.is_cuda and t.dtype == torch.bfloat16 and t.is_contiguous()
                and t.data_ptr() % 16 == 0 for t in tensors)
            and routed.dim() == 2 and routed.shape == shared.shape
            and routed.shape[1] % _VECTOR == 0 and gate.numel() == routed.shape[0])


def shared_expert_combine(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """routed, shared: bf16 [T, H] (H a multiple of 8); gate: bf16 [T, 1] or
    [T], the shared_expert_gate logits. Returns (or fills) out, bf16 [T, H]:
    bf16(routed + bf16(bf16(sigmoid(gate)) * shared)). out may be routed or
    shared itself."""
    check_cuda_tensor("routed", routed, dtype=torch.bfloat16, ndim=2)
    check_cuda_tensor("shared", shared, dtype=torch.bfloat16, ndim=2, device=routed.device)
    tokens, hidden = routed.shape
    if shared.shape != routed.shape:
        raise ValueError(f"shared must be {tuple(routed.shape)}, got {tuple(shared.shape)}")
    if hidden % _VECTOR:
        raise ValueError(f"the hidden size must be a multiple of {_VECTOR}, got {hidden}")
    check_cuda_tensor("gate", gate, dtype=torch.bfloat16, ndim=gate.dim(), device=routed.device)
    if gate.numel() != tokens or gate.dim() not in (1, 2):
        raise ValueError(f"gate must be [{tokens}] or [{tokens}, 1], got {tuple(gate.shape)}")
    if out is None:
        out = torch.empty_like(routed)
    else:
        check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=2, device=routed.device)
        if out.shape != routed.shape:
            raise ValueError(f"out must be {tuple(routed.shape)}, got {tuple(out.shape)}")
    for name, tensor in (("routed", routed), ("shared", shared), ("out", out)):
        if tensor.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address")
    if tokens == 0:
        return out
    grid = -(-(tokens * hidden // _VECTOR) // _THREADS)
    if grid >= 2**31:
        raise ValueError(f"too many tokens ({tokens}) for one launch")
    kernel = load_kernel(_SOURCE, "shared_expert_combine", routed.device.index or 0)
    args = (ptr(out), ptr(routed), ptr(shared), ptr(gate), np.int32(tokens), np.int32(hidden))
    launch(kernel, (grid,), (_THREADS,), args, routed.device)
    return out
