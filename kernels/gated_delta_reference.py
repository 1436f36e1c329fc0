"""Torch reference of the Gated DeltaNet linear-attention ops (Qwen3-Next, Qwen3.5).

A Gated DeltaNet layer mixes tokens through a short causal depthwise
convolution over its q|k|v channels and then a recurrent state per value
head, updated by the gated delta rule. Both carry state between steps, kept
in pools indexed by a slot per sequence:

- conv_states [S, C, K-1]: the last K-1 conv inputs of the sequence (oldest
  first), in the activation dtype;
- states [S, Hv, Dk, Dv]: the recurrent state, a Dk x Dv matrix per value
  head that maps a key to a value (transformers' layout; float32 there and
  advised here: decay and delta updates accumulate over the whole sequence).

The batch is laid out as the engine lays it out: the tokens of all sequences
concatenated, sequence i spanning query_start_loc[i]:query_start_loc[i + 1]
(a host tuple of B + 1 ints), its state in slot slots[i]; a sequence with
fresh[i] set starts from zero state, the others continue from their slot
(a sequence with no tokens leaves its slot untouched).
Both ops update the slots in place. These functions loop over sequences on
the host: they are the CPU path and what CUDA kernels are checked against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# The epsilon inside transformers' (and FLA's) q/k L2 norm: x * rsqrt(sum(x^2) + eps).
L2NORM_EPS = 1e-6


def _sequences(query_start_loc: Sequence[int], slots: torch.Tensor,
               fresh: torch.Tensor) -> list[tuple[int, int, int, bool]]:
    """(start, end, slot, fresh) per sequence, read back to the host once."""
    slot_list = [int(s) for s in slots.tolist()]
    fresh_list = [bool(f) for f in fresh.tolist()]
    assert len(query_start_loc) == len(slot_list) + 1 == len(fresh_list) + 1
    # Two sequences writing one slot would race on a GPU; forbid it here too.
    assert len(set(slot_list)) == len(slot_list), "a slot appears twice in one batch"
    return [(query_start_loc[i], query_start_loc[i + 1], slot_list[i], fresh_list[i])
            for i in range(len(slot_list))]


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token, per-value-head decay and write strength.

    a, b: [T, Hv] projections of the hidden state; a_log, dt_bias: [Hv] layer
    parameters. Returns (g, beta): g = -exp(A_log) * softplus(a + dt_bias),
    the log of the decay applied to the state (<= 0), in float32 because exp
    of A_log overflows half precision; beta = sigmoid(b) in b's dtype, as the
    models compute it (the delta rule casts it to float32)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                  query_start_loc: Sequence[int]) -> torch.Tensor:
    """Depthwise causal convolution over each sequence, then SiLU.

    x [T, C]; weight [C, K]; bias [C] or None; conv_states [S, C, K-1].
    Returns y [T, C] in x's dtype: y[t, c] = silu(bias[c] + sum_j weight[c, j]
    * x[t - K + 1 + j, c]), where inputs before the sequence's first token in
    this batch come from its conv state (zeros when fresh). conv_states[slot]
    becomes the last K-1 inputs of the sequence so far, which includes older
    inputs when this chunk is shorter than K-1.

    NOTE: computed in float32 and rounded once; transformers convolves in the
    weight dtype and applies SiLU there, so bf16 results may differ by a
    rounding step (FLA's and vLLM's kernels also accumulate in float32)."""
    channels, width = weight.shape
    assert x.dim() == 2 and x.shape[1] == channels
    assert conv_states.shape[1:] == (channels, width - 1)
    y = torch.empty_like(x)
    kernel = weight.float().unsqueeze(1)  # [C, 1, K]: one filter per channel
    bias32 = None if bias is None else bias.float()
    for start, end, slot, is_fresh in _sequences(query_start_loc, slots, fresh):
        if end == start:
            continue
        history = (torch.zeros_like(conv_states[slot]) if is_fresh else conv_states[slot])
        window = torch.cat([history.float(), x[start:end].float().t()], dim=1)  # [C, K-1+L]
        out = F.conv1d(window.unsqueeze(0), kernel, bias32, groups=channels)[0]  # [C, L]
        y[start:end] = F.silu(out).t().to(x.dtype)
        # Slice from an explicit start: with K == 1 "[-0:]" would keep everything.
        conv_states[slot].copy_(window[:, window.shape[1] - (width - 1):])
    return y


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32, head-major [H, T, ...] operands with q/k L2-normalised, q scaled
    by Dk^-0.5 and k/q heads repeated to one per value head."""
    num_k_heads, num_v_heads = k.shape[1], v.shape[1]
    assert num_v_heads % num_k_heads == 0
    # Each q/k head serves num_v_heads // num_k_heads consecutive value heads.
    group = num_v_heads // num_k_heads
    q32 = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k32 = _l2norm(k.float())
    q32, k32 = (t.repeat_interleave(group, dim=1) for t in (q32, k32))
    return tuple(t.float().transpose(0, 1) for t in (q32, k32, v, g, beta))


def _recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token on prepared operands ([H, L, ...]); state [H, Dk, Dv]
    float32. Returns (o [H, L, Dv], final state)."""
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[:, t], state)
        delta = beta[:, t, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[:, t], state))
    return torch.stack(outputs, dim=1), state


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor,
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, chunk_size tokens at a time (the last chunk may be
    shorter; nothing is padded).

    Within a chunk, with Gam_i = exp(cumsum g up to i) and S0 the state at its
    start, unrolling the recurrence gives S_i = Gam_i S0 + sum_{j<=i}
    (Gam_i / Gam_j) k_j u_j^T, where the written values u solve the unit
    lower-triangular system (I + A) u = beta v - beta Gam (K S0) with
    A_ij = beta_i (Gam_i / Gam_j) k_i.k_j for j < i. Outputs are then
    o_i = Gam_i q_i S0 + sum_{j<=i} (Gam_i / Gam_j) (q_i.k_j) u_j."""
    length = q.shape[1]
    outputs = []
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        log_gam = g[:, start:end].cumsum(dim=1)  # [H, L]
        n = end - start
        # Ratios Gam_i / Gam_j for j <= i; above the diagonal the exponent is
        # positive and may overflow, so mask in log space before exp.
        upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        ratio = (log_gam[:, :, None] - log_gam[:, None, :]).masked_fill(upper, float("-inf")).exp()
        coupling = (kc @ kc.transpose(1, 2)) * ratio * bc[:, :, None]
        system = torch.eye(n, dtype=torch.float32, device=q.device) + coupling.tril(-1)
        rhs = torch.cat([bc[:, :, None] * vc, (bc * log_gam.exp())[:, :, None] * kc], dim=2)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        dv = vc.shape[2]
        u = solved[:, :, :dv] - solved[:, :, dv:] @ state  # [H, L, Dv]
        attention = (qc @ kc.transpose(1, 2)) * ratio  # zero above the diagonal
        outputs.append((qc * log_gam.exp()[:, :, None]) @ state + attention @ u)
        last = log_gam[:, -1:]
        carried = kc * (last - log_gam).exp()[:, :, None]  # keys decayed to the chunk end
        state = state * last.exp()[:, :, None] + carried.transpose(1, 2) @ u
    return torch.cat(outputs, dim=1), state


def _run_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
              fresh: torch.Tensor, query_start_loc: Sequence[int],
              chunk_size: int | None) -> torch.Tensor:
    assert q.shape == k.shape and v.shape[0] == q.shape[0]
    assert g.shape == beta.shape == v.shape[:2]
    assert states.shape[1:] == (v.shape[1], k.shape[2], v.shape[2])
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for start, end, slot, is_fresh in _sequences(query_start_loc, slots, fresh):
        if end == start:
            continue
        operands = _prepare(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end])
        initial = torch.zeros_like(states[slot], dtype=torch.float32) if is_fresh else states[slot].float()
        if chunk_size is None or end - start == 1:
            out, final = _recurrent(*operands, initial)
        else:
            out, final = _chunked(*operands, initial, chunk_size)
        o[start:end] = out.transpose(0, 1).to(q.dtype)
        states[slot].copy_(final)
    return o


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                     fresh: torch.Tensor, query_start_loc: Sequence[int], *,
                     chunk_size: int = 64) -> torch.Tensor:
    """Gated delta rule attention over each sequence, continuing its slot state.

    q, k [T, Hk, Dk] (after the conv, not normalised); v [T, Hv, Dv]; g [T, Hv]
    log decay and beta [T, Hv] from gdn_gating; states [S, Hv, Dk, Dv].
    Returns o [T, Hv, Dv] in q's dtype. Per token and value head h (q/k head
    h // (Hv / Hk)), with q and k L2-normalised and q scaled by Dk^-0.5:
        S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
    NOTE: the L2 norm and scaling happen inside the op, in float32, as
    transformers' use_qk_l2norm_in_kernel=True (which both models always
    pass) and FLA's kernels do: a fused kernel normalises what it loads.

    A sequence of several tokens runs the chunked form, one of a single
    token (decode) the recurrent form; both in float32. states[slot] becomes
    the state after the sequence's last token, cast to the pool's dtype."""
    return _run_rule(q, k, v, g, beta, states, slots, fresh, query_start_loc, chunk_size)


def gated_delta_rule_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                           fresh: torch.Tensor, query_start_loc: Sequence[int]) -> torch.Tensor:
    """gated_delta_rule by the per-token recurrence alone: the definition the
    chunked form is tested against."""
    return _run_rule(q, k, v, g, beta, states, slots, fresh, query_start_loc, None)
