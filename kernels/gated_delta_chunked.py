"""The gated delta rule of prompt sequences in the chunked (chunk-parallel) form, in torch.

kernels/gated_delta.py's recurrent kernel walks a sequence token by token: a
long prompt costs one latency-bound step per token and layer (about 1.2 us
at Qwen3.5's shape on an H200). This module computes the same recurrence 64
tokens at a time, as batched float32 matrix products (the UT form of the
reference's `_chunked`, arranged as FLA's chunk-parallel algorithm):

1. gating (gdn_gating), q/k L2 norm and Dk^-0.5 scale, heads repeated, all
   chunks of a window laid out chunk-major [C, Hv, 64, D];
2. for every chunk at once: the cumulative log decay G, the unit
   lower-triangular system (I + A) with A_ij = beta_i exp(G_i - G_j) k_i.k_j
   (j < i), inverted, giving u = T (beta v) and w = T (beta exp(G) k), and
   with K~ = k exp(G_last - G) (keys decayed to the chunk end) the chunk's
   state map S -> M S + B, M = exp(G_last) I - K~^T w, B = K~^T u;
3. the only sequential part, over chunks: S_{c+1} = M_c S_c + B_c, one
   batched matmul per chunk, keeping each chunk's starting state S_c;
4. for every chunk at once: v_new_c = u_c - w_c S_c and o_c = (q_c exp(G))
   S_c + (q_c k_c^T * exp(G_i - G_j), causal) v_new_c.

The last chunk is padded with zero q/k/v, g = 0 and beta = 0: a padded row
writes nothing (its u and w rows are beta times something) and leaves the
chunk's decay as it was, so results are exactly those of the unpadded
sequence. A sequence is processed in windows of WINDOW_TOKENS (each window
starts from the state the previous one ended in) so the per-chunk states
and operands stay bounded (about 0.8 GB at 32 heads of 128 x 128).

It is torch, so it runs on the CPU as well (where the tests compare it with
kernels.gated_delta_reference). It reads the sequence bounds on the host
(query_start_loc_host) and runs a host loop per chunk: eager steps only;
inside CUDA graphs the recurrent kernel serves every sequence. Slots and
fresh flags stay on the device (no sync): a sequence's slot must be valid
(>= 0), as it always is in eager steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from kernels.gated_delta_reference import L2NORM_EPS, gdn_gating

CHUNK_SIZE = 64
# NOTE: a sequence with at least this many tokens in a step runs chunked.
# Measured on the H200 at Qwen3.5's shape (Hk 16, Hv 32, Dk = Dv = 128, one
# layer; tests/perf/bench_gated_delta_prefill.py, 2026-12-02): the recurrent
# kernel takes 1.0 us a token at any length; the chunked form 7.8 / 1.7 /
# 0.80 / 0.79 us a token at 256 / 1,024 / 8,192 / 32,768 tokens, about 1 ms
# of launches a window plus 0.8 us a token. It wins from about 5,000 tokens.
MIN_CHUNKED_TOKENS = 6144
WINDOW_TOKENS = 64 * CHUNK_SIZE


def chunked_sequences(query_start_loc_host: Sequence[int],
                      min_tokens: int = MIN_CHUNKED_TOKENS) -> list[int]:
    """Indices of the sequences long enough for the chunked form. Empty when
    the bounds are not on the host (a CUDA graph's step passes ())."""
    return [i for i in range(len(query_start_loc_host) - 1)
            if query_start_loc_host[i + 1] - query_start_loc_host[i] >= min_tokens]


@contextmanager
def _ieee_float32_matmuls() -> Iterator[None]:
    """float32 matmuls in full precision here whatever the process set: TF32
    (10-bit mantissa) would put the results well outside float32 rounding
    of the reference."""
    matmul = torch.backends.cuda.matmul
    # fp32_precision is torch >= 2.9's switch; allow_tf32 the older one.
    flag, ieee = (("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision")
                  else ("allow_tf32", False))
    before = getattr(matmul, flag)
    setattr(matmul, flag, ieee)
    try:
        yield
    finally:
        setattr(matmul, flag, before)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # The reference's formula, so CPU results agree to the last bit or two.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _chunk_major(x: torch.Tensor, chunks: int, group: int = 1) -> torch.Tensor:
    """[P, H, ...] (P = chunks * CHUNK_SIZE) -> contiguous [C, H * group, CHUNK_SIZE, ...],
    head h of the result reading head h // group of x."""
    heads, rest = x.shape[1], x.shape[2:]
    x = x.reshape(chunks, CHUNK_SIZE, heads, 1, *rest)
    x = x.expand(chunks, CHUNK_SIZE, heads, group, *rest).reshape(
        chunks, CHUNK_SIZE, heads * group, *rest)
    return x.transpose(1, 2).contiguous()


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
    """Step 1 for one window of one sequence: (q, k, v, g, beta) float32,
    chunk-major, zero-padded to whole chunks."""
    length = q.shape[0]
    chunks = -(-length // CHUNK_SIZE)
    pad = chunks * CHUNK_SIZE - length
    group = v.shape[1] // k.shape[1]
    g, beta = gdn_gating(a, b, a_log, dt_bias)  # beta in b's dtype, as the reference
    q32 = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k32 = _l2norm(k.float())
    padded = [F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad))
              for t in (q32, k32, v, g, beta)]
    return (_chunk_major(padded[0], chunks, group), _chunk_major(padded[1], chunks, group),
            *(_chunk_major(t, chunks) for t in padded[2:]))


def _run_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-4 on chunk-major operands (q, k [C, H, L, Dk], v [C, H, L, Dv],
    g, beta [C, H, L]) from state [H, Dk, Dv] float32. Returns (o [C, H, L,
    Dv], the state after the last chunk)."""
    chunks, size = v.shape[0], v.shape[2]
    log_gam = g.cumsum(dim=-1)  # G: [C, H, L]
    # exp(G_i - G_j) for j <= i; above the diagonal the exponent is positive
    # and may overflow, so mask in log space before exp.
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    ratio = (log_gam[..., :, None] - log_gam[..., None, :]).masked_fill(upper, float("-inf")).exp()
    coupling = (k @ k.mT).mul_(ratio).mul_(beta[..., None])
    # The diagonal is never read (unitriangular) and above it ratio is zero:
    # `coupling` is the strictly lower part A of (I + A) as it stands.
    eye = torch.eye(size, dtype=torch.float32, device=q.device)
    inverse = torch.linalg.solve_triangular(coupling, eye.expand_as(coupling), upper=False,
                                            unitriangular=True)
    del coupling
    gam = log_gam.exp()
    u = inverse @ (v * beta[..., None])  # becomes v_new below
    w = inverse @ (k * (beta * gam)[..., None])
    del inverse
    last = log_gam[..., -1:]  # [C, H, 1]
    carried = (k * (last - log_gam).exp()[..., None]).mT  # keys decayed to the chunk end
    # NOTE: S_{c+1} = exp(G_last) S_c + carried_c (u_c - w_c S_c) is the affine
    # map S -> M_c S + B_c with M_c = exp(G_last) I - carried_c w_c and
    # B_c = carried_c u_c, both computed for all chunks at once: the loop is
    # then one batched matmul per chunk instead of three launches.
    transition = carried @ w  # becomes M_c: [C, H, Dk, Dk]
    transition.neg_().diagonal(dim1=-2, dim2=-1).add_(last.exp())
    starts = torch.empty(chunks + 1, *state.shape, dtype=torch.float32, device=q.device)
    starts[0] = state
    torch.matmul(carried, u, out=starts[1:])  # B_c, M_c S_c added below
    del carried
    # unbind makes every chunk's view in one call: the loop is host-bound.
    start_views, transitions = starts.unbind(0), transition.unbind(0)
    for c in range(chunks):
        start_views[c + 1].baddbmm_(transitions[c], start_views[c])
    del transition
    u -= w @ starts[:chunks]  # the values written: v_new_c = u_c - w_c S_c
    del w

    attention = (q @ k.mT).mul_(ratio)  # ratio is zero above the diagonal: causal
    out = (q * gam[..., None]) @ starts[:chunks]
    out += attention @ u
    return out, starts[chunks]


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                             dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                             fresh: torch.Tensor, query_start_loc_host: Sequence[int],
                             sequences: Sequence[int] | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Gating + gated delta rule of the listed sequences (all by default) in
    the chunked form; what kernels.gated_delta.gated_delta_rule computes.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; a, b [T, Hv]; a_log, dt_bias [Hv];
    states [S, Hv, Dk, Dv] float32, updated in place; slots [B], fresh [B]
    on the operands' device; query_start_loc_host: the B + 1 bounds on the
    host. Returns (or fills) out [T, Hv, Dv] in q's dtype: the listed
    sequences' rows are written, no others. A listed sequence with no
    tokens leaves its slot untouched; two listed sequences must not share
    a slot.
    """
    assert q.shape == k.shape and v.shape[0] == q.shape[0] and v.shape[1] % k.shape[1] == 0
    assert states.dtype == torch.float32
    assert states.shape[1:] == (v.shape[1], k.shape[2], v.shape[2])
    if out is None:
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if sequences is None:
        sequences = range(len(query_start_loc_host) - 1)
    with _ieee_float32_matmuls():
        for i in sequences:
            start, end = query_start_loc_host[i], query_start_loc_host[i + 1]
            if end == start:
                continue
            slot = slots[i:i + 1].long()
            # torch.where, not a host branch on fresh[i]: no device sync.
            state = torch.where(fresh[i], 0.0, states.index_select(0, slot)[0])
            for first in range(start, end, WINDOW_TOKENS):
                last = min(first + WINDOW_TOKENS, end)
                rows = slice(first, last)
                operands = _prepare(q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias)
                o, state = _run_window(*operands, state)
                # [C, H, L, Dv] -> [C * L, H, Dv], padding rows dropped.
                o = o.transpose(1, 2).reshape(-1, *v.shape[1:])[:last - first]
                out[rows] = o.to(out.dtype)
            states.index_copy_(0, slot, state[None])
    return out
