"""The gated delta rule of prompt sequences in the chunked form, one CUDA kernel on tensor cores.

kernels/gated_delta.py's recurrent kernel walks a prompt token by token (1.0
us a token per layer at Qwen3.5's shape on an H200); kernels/gated_delta_chunked.py
computes the chunked form in torch, with host loops and launches per chunk
(eager steps only). This kernel (kernels/csrc/gated_delta_chunked.cu) does
the chunked form for a whole batch in one launch: a CTA per (sequence, value
head, 32 value columns) keeps its block of the float32 state in shared memory
and walks the sequence's 64-token chunks in order, each chunk's matrix
products on the tensor cores (mma.sync TF32 as 3xTF32, float32 accumulate:
float32 accuracy), the 64 x 64 triangular solve in float32 FMA.

Like the recurrent kernel it reads the batch on the device (query_start_loc,
slots, fresh), launches a grid sized by shapes alone, and so runs inside CUDA
graphs. Sequences with fewer than min_tokens tokens are skipped (their output
rows unwritten, their slots untouched): the caller runs the recurrent kernel
for those, where a chunk's worth of matrix work for a token or two would cost
more than the token loop.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import launch, load_kernel, ptr, set_max_dynamic_shared
from kernels.gated_delta import _check_batch, _check_out, _check_rows, _gate_parameter

_SOURCE = "gated_delta_chunked.cu"
KEY_DIM = 128  # kDk in the source
VALUE_BLOCK = 32  # value columns per CTA (kCols)
_THREADS = 256
# The kernel's shared memory (kSharedFloats * 4 in the source, checked there):
# Q, K [64][132], S [128][40], A, M [64][68], X, Xd [64][40], 4 x 64 + 4 floats.
SHARED_BYTES = 4 * (2 * 64 * 132 + 128 * 40 + 2 * 64 * 68 + 2 * 64 * 40 + 4 * 64 + 4)
# NOTE: sequences shorter than this stay on the recurrent kernel (CudaOps'
# dispatch). Measured on the H200 at Qwen3.5's shape, one layer
# (tests/perf/bench_gated_delta_prefill.py, 2026-12-02): 16 tokens take this
# kernel 0.109 ms and the recurrent one 0.082; 64 tokens 0.105 and 0.130.
MIN_TC_TOKENS = 32
_L2NORM_EPS = 1e-6  # kernels.gated_delta_reference.L2NORM_EPS


def tc_supported(key_dim: int, value_dim: int) -> bool:
    """Whether the tensor-core chunked kernel is built for these head sizes."""
    return key_dim == KEY_DIM and value_dim > 0 and value_dim % VALUE_BLOCK == 0


def gated_delta_rule_tc(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                        states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                        query_start_loc: torch.Tensor, out: torch.Tensor | None = None,
                        min_tokens: int = 1) -> torch.Tensor:
    """Gating + gated delta rule of every sequence with at least min_tokens
    tokens, in the chunked form; operands, batch layout and result as
    kernels.gated_delta.gated_delta_rule's, with Dk 128 and Dv a multiple of
    32. Rows of shorter sequences in out are left as they were, and so are
    their slots (and those of sequences with slot < 0 or no tokens).
    """
    device = q.device
    tokens, num_k_heads, key_dim = q.shape
    if v.dim() != 3:
        raise ValueError(f"v must be [T, Hv, Dv], got {tuple(v.shape)}")
    num_v_heads, value_dim = v.shape[1], v.shape[2]
    if not tc_supported(key_dim, value_dim):
        raise ValueError(f"head dims (Dk {key_dim}, Dv {value_dim}) not built: Dk must be "
                         f"{KEY_DIM}, Dv a multiple of {VALUE_BLOCK}")
    if num_k_heads == 0 or num_v_heads % num_k_heads:
        raise ValueError(f"Hv ({num_v_heads}) must be a multiple of Hk ({num_k_heads})")
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
    qk_stride = _check_rows("q", q, (tokens, num_k_heads, key_dim))
    if _check_rows("k", k, (tokens, num_k_heads, key_dim)) != qk_stride and tokens > 1:
        raise ValueError(f"q and k must have one row stride, got {q.stride(0)} and {k.stride(0)}")
    v_stride = _check_rows("v", v, (tokens, num_v_heads, value_dim))
    a_stride = _check_rows("a", a, (tokens, num_v_heads))
    b_stride = _check_rows("b", b, (tokens, num_v_heads))
    a_log = _gate_parameter("a_log", a_log, num_v_heads, device)
    dt_bias = _gate_parameter("dt_bias", dt_bias, num_v_heads, device)
    if not states.is_cuda or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("states must be a contiguous float32 CUDA tensor")
    if states.dim() != 4 or states.shape[1:] != (num_v_heads, key_dim, value_dim):
        raise ValueError(f"states must be [S, {num_v_heads}, {key_dim}, {value_dim}], got "
                         f"{tuple(states.shape)}")
    slots, fresh, num_seqs = _check_batch(slots, fresh, query_start_loc, device)
    out = _check_out(out, (tokens, num_v_heads, value_dim), device)
    if tokens == 0 or num_seqs == 0:
        return out
    kernel = load_kernel(_SOURCE, "gated_delta_chunked_dk128", device.index or 0)
    set_max_dynamic_shared(kernel, SHARED_BYTES)
    grid = (num_seqs, num_v_heads, value_dim // VALUE_BLOCK)
    args = (ptr(out), ptr(states), ptr(q), ptr(k), np.int64(qk_stride), ptr(v),
            np.int64(v_stride), ptr(a), np.int64(a_stride), ptr(b), np.int64(b_stride),
            ptr(a_log), ptr(dt_bias), ptr(slots), ptr(fresh), ptr(query_start_loc),
            np.int32(num_k_heads), np.int32(num_v_heads), np.int32(value_dim),
            np.int32(min_tokens), np.float32(key_dim**-0.5), np.float32(_L2NORM_EPS))
    launch(kernel, grid, (_THREADS,), args, device, shared_bytes=SHARED_BYTES)
    return out
