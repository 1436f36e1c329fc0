"""SwiGLU (silu(gate) * up) on the GPU; reference: kernels.reference.silu_and_mul."""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor, launch, load_kernel, ptr

_THREADS = 128
_VECTOR = 8  # bf16 per 16-byte access


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: bf16 [T, 2 * I] with the gate in the first half, I a multiple of 8.
    Returns (or fills) bf16 [T, I]."""
    check_cuda_tensor("x", x, dtype=torch.bfloat16, ndim=2)
    tokens, width = x.shape
    intermediate = width // 2
    if width % 2 or intermediate % _VECTOR:
        raise ValueError(f"x's last dim must be 2 * I with I a multiple of {_VECTOR}, got {width}")
    if out is None:
        out = torch.empty((tokens, intermediate), dtype=x.dtype, device=x.device)
    else:
        check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=2, device=x.device)
        if out.shape != (tokens, intermediate):
            raise ValueError(f"out must be {(tokens, intermediate)}, got {tuple(out.shape)}")
    if tokens == 0:
        return out
    kernel = load_kernel("activation.cu", "silu_and_mul_bf16", x.device.index or 0)
    blocks = -(-intermediate // (_VECTOR * _THREADS))
    launch(kernel, (tokens, blocks), (_THREADS,), (ptr(out), ptr(x), np.int32(intermediate)),
           x.device)
    return out
