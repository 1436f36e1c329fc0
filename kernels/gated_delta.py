"""Gated DeltaNet linear attention on the GPU: the causal conv and the gated delta rule.

References: kernels.gated_delta_reference.causal_conv1d, gdn_gating and
gated_delta_rule; the batch layout is theirs, on the device (query_start_loc
int32 [B + 1], slots [B], fresh [B]).

- causal_conv1d: depthwise causal conv + SiLU, float32 accumulate, K 2..4;
  two launches (conv, then the conv-state update, which must wait until
  every token tile has read the old state).
- gated_delta_rule: the gating (g, beta) fused in, q/k L2 norm and the
  Dk^-0.5 scale fused, the recurrence token by token with each (sequence,
  value head, 32 value columns) block of the float32 state in registers.
  Dk 64, 128 or 256; Dv a multiple of 32.

NOTE: prompt steps run the same recurrent kernel, token by token over each
sequence (1.0 us a token and layer at Qwen3.5's shape on the H200): only a
sequence of thousands of tokens in an eager step takes the chunked form
(kernels/gated_delta_chunked.py, batched torch products). The reference
computes prompts in the chunked form; both are the same recurrence in
float32, equal up to summation order.

CUDA-graph safe: nothing is read back to the host, the grids depend only on
the shapes, and with `out` given nothing is allocated except where an input
needs converting (int32 slots, bf16 a_log/dt_bias: tiny copies, also fine
under capture). Tensor contents are not checked (that would sync): a slot < 0
means "no slot" (graph padding): the conv sees a zero state there and writes
none, the delta rule skips the sequence (its output rows stay unwritten).
Rows past query_start_loc[B] get zeros from the conv and nothing from the
delta rule. Two sequences of one batch must not share a slot.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_build import check_cuda_tensor, launch, load_kernel, ptr, tensors_overlap

_SOURCE = "gated_delta.cu"
_CONV_WIDTHS = (2, 3, 4)
_CONV_TILE = 16  # rows per conv thread (TILE in the source)
_CONV_THREADS = 128
_KEY_DIMS = (64, 128, 256)
_VALUE_BLOCK = 32  # value columns per delta-rule CTA
_DELTA_THREADS = 128
# The eps inside the q/k L2 norm (kernels.gated_delta_reference.L2NORM_EPS).
_L2NORM_EPS = 1e-6


def conv_supported(width: int) -> bool:
    """Whether causal_conv1d is built for conv width K."""
    return width in _CONV_WIDTHS


def rule_supported(key_dim: int, value_dim: int) -> bool:
    """Whether gated_delta_rule is built for these head sizes."""
    return key_dim in _KEY_DIMS and value_dim > 0 and value_dim % _VALUE_BLOCK == 0


def _check_batch(slots: torch.Tensor, fresh: torch.Tensor, query_start_loc: torch.Tensor,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(int64 slots, uint8 fresh, B) after checking the batch layout's shapes."""
    check_cuda_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1,
                      device=device)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must have B + 1 entries")
    if slots.dtype == torch.int32:
        slots = slots.long()
    check_cuda_tensor("slots", slots, dtype=torch.int64, ndim=1, device=device)
    if fresh.dtype == torch.bool:
        fresh = fresh.view(torch.uint8)
    check_cuda_tensor("fresh", fresh, dtype=torch.uint8, ndim=1, device=device)
    if slots.shape[0] != num_seqs or fresh.shape[0] != num_seqs:
        raise ValueError(f"slots {tuple(slots.shape)} and fresh {tuple(fresh.shape)} must both "
                         f"be [{num_seqs}] (query_start_loc has B + 1 entries)")
    return slots, fresh, num_seqs


def _check_rows(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> int:
    """Check a bf16 [T, ...] operand whose rows may be strided (a view of a
    wider projection) but are contiguous inside; returns the row stride."""
    if not x.is_cuda or x.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be a bf16 CUDA tensor, got {x.dtype} on {x.device}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must be {shape}, got {tuple(x.shape)}")
    if x.shape[0] and not x[0].is_contiguous():
        raise ValueError(f"{name}'s rows must be contiguous, got strides {x.stride()}")
    return x.stride(0)


def _check_out(out: torch.Tensor | None, shape: tuple[int, ...],
               device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    check_cuda_tensor("out", out, dtype=torch.bfloat16, ndim=len(shape), device=device)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must be {shape}, got {tuple(out.shape)}")
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                  query_start_loc: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x: bf16 [T, C] (rows may be strided); weight: bf16 [C, K], K 2..4;
    bias: bf16 [C] or None; conv_states: bf16 [S, C, K-1], updated in place;
    slots: int64 (or int32) [B]; fresh: bool [B]; query_start_loc: int32 [B + 1].

    Returns (or fills) out, bf16 [T, C]: silu(conv(window) + bias), float32
    accumulate, rounded once. out must not overlap x (the state update
    reads x after the conv has written out).
    """
    device = x.device
    tokens = x.shape[0]
    check_cuda_tensor("weight", weight, dtype=torch.bfloat16, ndim=2, device=device)
    channels, width = weight.shape
    if width not in _CONV_WIDTHS:
        raise ValueError(f"conv width must be one of {_CONV_WIDTHS}, got {width}")
    x_stride = _check_rows("x", x, (tokens, channels))
    if bias is not None:
        check_cuda_tensor("bias", bias, dtype=torch.bfloat16, ndim=1, device=device)
        if bias.shape[0] != channels:
            raise ValueError(f"bias must be [{channels}], got {tuple(bias.shape)}")
    check_cuda_tensor("conv_states", conv_states, dtype=torch.bfloat16, ndim=3, device=device)
    if conv_states.shape[1:] != (channels, width - 1):
        raise ValueError(f"conv_states must be [S, {channels}, {width - 1}], got "
                         f"{tuple(conv_states.shape)}")
    slots, fresh, num_seqs = _check_batch(slots, fresh, query_start_loc, device)
    out = _check_out(out, (tokens, channels), device)
    if tokens and tensors_overlap(out, x):
        raise ValueError("out must not overlap x (the state update reads x after the conv)")
    if tokens == 0 or num_seqs == 0:
        return out
    if tokens >= 2**31 - _CONV_TILE:
        raise ValueError(f"too many tokens ({tokens}) for one launch")
    channel_blocks = -(-channels // _CONV_THREADS)
    index = device.index or 0
    bias_ptr = ptr(bias) if bias is not None else np.uint64(0)
    conv = load_kernel(_SOURCE, f"causal_conv1d_k{width}", index)
    launch(conv, (-(-tokens // _CONV_TILE), channel_blocks), (_CONV_THREADS,),
           (ptr(out), ptr(x), np.int64(x_stride), ptr(weight), bias_ptr, ptr(conv_states),
            ptr(slots), ptr(fresh), ptr(query_start_loc), np.int32(num_seqs), np.int32(tokens),
            np.int32(channels)), device)
    update = load_kernel(_SOURCE, f"conv_state_update_k{width}", index)
    launch(update, (num_seqs, channel_blocks), (_CONV_THREADS,),
           (ptr(x), np.int64(x_stride), ptr(conv_states), ptr(slots), ptr(fresh),
            ptr(query_start_loc), np.int32(channels)), device)
    return out


def _gate_parameter(name: str, param: torch.Tensor, heads: int,
                    device: torch.device) -> torch.Tensor:
    if param.shape != (heads,):
        raise ValueError(f"{name} must be [{heads}], got {tuple(param.shape)}")
    param = param.float().contiguous()  # exact from bf16; a no-op when already float32
    check_cuda_tensor(name, param, dtype=torch.float32, ndim=1, device=device)
    return param


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                     query_start_loc: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Gating + gated delta rule over each sequence, continuing its slot state.

    q, k: bf16 [T, Hk, Dk] (Dk 64, 128 or 256; rows may be strided, q and k
    with the same row stride); v: bf16 [T, Hv, Dv] (Dv a multiple of 32);
    a, b: bf16 [T, Hv]; a_log, dt_bias: [Hv] (bf16 or float32); states:
    float32 [S, Hv, Dk, Dv], updated in place; slots, fresh, query_start_loc
    as causal_conv1d's. Value head h reads q/k head h // (Hv / Hk).

    Returns (or fills) out, bf16 [T, Hv, Dv]: what
    gated_delta_rule(q, k, v, *gdn_gating(a, b, a_log, dt_bias), ...) returns.
    """
    device = q.device
    tokens, num_k_heads, key_dim = q.shape
    if v.dim() != 3:
        raise ValueError(f"v must be [T, Hv, Dv], got {tuple(v.shape)}")
    num_v_heads, value_dim = v.shape[1], v.shape[2]
    if key_dim not in _KEY_DIMS:
        raise ValueError(f"key head dim must be one of {_KEY_DIMS}, got {key_dim}")
    if value_dim % _VALUE_BLOCK or value_dim == 0:
        raise ValueError(f"value head dim must be a multiple of {_VALUE_BLOCK}, got {value_dim}")
    if num_k_heads == 0 or num_v_heads % num_k_heads:
        raise ValueError(f"Hv ({num_v_heads}) must be a multiple of Hk ({num_k_heads})")
    qk_stride = _check_rows("q", q, (tokens, num_k_heads, key_dim))
    if _check_rows("k", k, (tokens, num_k_heads, key_dim)) != qk_stride and tokens > 1:
        raise ValueError(f"q and k must have one row stride, got {q.stride(0)} and {k.stride(0)}")
    v_stride = _check_rows("v", v, (tokens, num_v_heads, value_dim))
    a_stride = _check_rows("a", a, (tokens, num_v_heads))
    b_stride = _check_rows("b", b, (tokens, num_v_heads))
    a_log = _gate_parameter("a_log", a_log, num_v_heads, device)
    dt_bias = _gate_parameter("dt_bias", dt_bias, num_v_heads, device)
    check_cuda_tensor("states", states, dtype=torch.float32, ndim=4, device=device)
    if states.shape[1:] != (num_v_heads, key_dim, value_dim):
        raise ValueError(f"states must be [S, {num_v_heads}, {key_dim}, {value_dim}], got "
                         f"{tuple(states.shape)}")
    slots, fresh, num_seqs = _check_batch(slots, fresh, query_start_loc, device)
    out = _check_out(out, (tokens, num_v_heads, value_dim), device)
    if tokens == 0 or num_seqs == 0:
        return out
    kernel = load_kernel(_SOURCE, f"gated_delta_rule_dk{key_dim}", device.index or 0)
    grid = (num_seqs, num_v_heads, value_dim // _VALUE_BLOCK)
    args = (ptr(out), ptr(states), ptr(q), ptr(k), np.int64(qk_stride), ptr(v),
            np.int64(v_stride), ptr(a), np.int64(a_stride), ptr(b), np.int64(b_stride),
            ptr(a_log), ptr(dt_bias), ptr(slots), ptr(fresh), ptr(query_start_loc),
            np.int32(num_k_heads), np.int32(num_v_heads), np.int32(value_dim),
            np.float32(key_dim**-0.5), np.float32(_L2NORM_EPS))
    launch(kernel, grid, (_DELTA_THREADS,), args, device)
    return out
