"""The Gated DeltaNet reference: the chunked rule against the per-token
recurrence, state carried through slots (pieces, decode steps, mixed batches)
against one pass, the stateful conv against a plain causal conv, and a whole
transformers GatedDeltaNet layer (Qwen3-Next and Qwen3.5) rebuilt from our ops."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels.gated_delta_reference import (
    causal_conv1d,
    gated_delta_rule,
    gated_delta_rule_naive,
    gdn_gating,
)

HK, HV, DK, DV, WIDTH, SLOTS = 2, 4, 16, 16, 4, 6
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _rule_inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HK, DK, generator=gen)
    k = torch.randn(tokens, HK, DK, generator=gen)
    v = torch.randn(tokens, HV, DV, generator=gen)
    # Decays from strong (exp(-4)) to almost none, as trained layers have.
    g = -4 * torch.rand(tokens, HV, generator=gen) ** 3
    beta = torch.rand(tokens, HV, generator=gen)
    return q, k, v, g, beta


def _pool(seed: int) -> torch.Tensor:
    return torch.randn(SLOTS, HV, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.3


def _one(slot: int, fresh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([slot]), torch.tensor([fresh])


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("tokens", [1, 5, 63, 64, 65, 200])
def test_chunked_equals_per_token_recurrence(tokens: int, chunk_size: int) -> None:
    q, k, v, g, beta = _rule_inputs(tokens, seed=tokens)
    states, expected_states = _pool(1), _pool(1)
    slots, fresh = _one(3, False)
    got = gated_delta_rule(q, k, v, g, beta, states, slots, fresh, (0, tokens),
                           chunk_size=chunk_size)
    expected = gated_delta_rule_naive(q, k, v, g, beta, expected_states, slots, fresh,
                                      (0, tokens))
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(states, expected_states, **TOL)


def test_naive_matches_a_scalar_recurrence() -> None:
    """The definition itself, one value head and one token at a time."""
    q, k, v, g, beta = _rule_inputs(6, seed=7)
    states = _pool(2)
    start = states[4].clone()
    got = gated_delta_rule_naive(q, k, v, g, beta, states, *_one(4, False), (0, 6))
    for h in range(HV):
        state = start[h].clone()
        kh = h // (HV // HK)
        for t in range(6):
            qt = q[t, kh] / q[t, kh].norm() / DK ** 0.5
            kt = k[t, kh] / k[t, kh].norm()
            state = state * g[t, h].exp()
            state = state + torch.outer(kt, beta[t, h] * (v[t, h] - kt @ state))
            torch.testing.assert_close(got[t, h], qt @ state, **TOL)
        torch.testing.assert_close(states[4, h], state, **TOL)


def test_pieces_and_decode_steps_equal_one_pass() -> None:
    q, k, v, g, beta = _rule_inputs(90, seed=11)
    one_pass_states = _pool(3)
    expected = gated_delta_rule(q, k, v, g, beta, one_pass_states, *_one(2, True), (0, 90),
                                chunk_size=16)
    states = _pool(4)  # garbage in slot 2: the first piece is fresh
    pieces = [(0, 3), (3, 40), (40, 70)] + [(t, t + 1) for t in range(70, 90)]
    outputs = []
    for start, end in pieces:
        outputs.append(gated_delta_rule(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end],
            states, *_one(2, start == 0), (0, end - start), chunk_size=16))
    torch.testing.assert_close(torch.cat(outputs), expected, **TOL)
    torch.testing.assert_close(states[2], one_pass_states[2], **TOL)


def test_mixed_batch_equals_each_sequence_alone() -> None:
    lengths, slot_ids, fresh_flags = [7, 1, 65, 3, 1], [2, 0, 5, 3, 1], [True, False, False, True, False]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    q, k, v, g, beta = _rule_inputs(starts[-1], seed=21)
    states = _pool(5)
    got = gated_delta_rule(q, k, v, g, beta, states, torch.tensor(slot_ids),
                           torch.tensor(fresh_flags), tuple(starts), chunk_size=16)
    alone_states = _pool(5)
    for i, (slot, is_fresh) in enumerate(zip(slot_ids, fresh_flags, strict=True)):
        s, e = starts[i], starts[i + 1]
        if is_fresh:  # fresh means zero state, whatever the slot held
            alone_states[slot].zero_()
        alone = gated_delta_rule_naive(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], alone_states,
                                       *_one(slot, False), (0, e - s))
        torch.testing.assert_close(got[s:e], alone, **TOL)
    torch.testing.assert_close(states, alone_states, **TOL)
    assert torch.equal(states[4], _pool(5)[4])  # a slot outside the batch is untouched


def test_half_precision_activations_keep_a_float32_state() -> None:
    """bf16 q/k/v/beta: the rule runs in float32, returns bf16 and writes the
    float32 pool without rounding it to bf16."""
    q, k, v, g, beta = _rule_inputs(40, seed=31)
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))  # g stays float32
    states, expected_states = _pool(7), _pool(7)
    got = gated_delta_rule(q, k, v, g, beta, states, *_one(0, False), (0, 40), chunk_size=16)
    expected = gated_delta_rule_naive(q.float(), k.float(), v.float(), g, beta.float(),
                                      expected_states, *_one(0, False), (0, 40))
    assert got.dtype == torch.bfloat16 and states.dtype == torch.float32
    torch.testing.assert_close(got, expected.bfloat16(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(states, expected_states, **TOL)


def _full_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Zero-padded causal conv over one whole sequence, then SiLU: x [T, C]."""
    out = F.conv1d(x.t()[None], weight[:, None, :], bias, padding=WIDTH - 1,
                   groups=x.shape[1])[0, :, :x.shape[0]]
    return F.silu(out).t()


def _conv_inputs(tokens: int, channels: int = 24) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, channels, generator=gen)
    weight = torch.randn(channels, WIDTH, generator=gen)
    bias = torch.randn(channels, generator=gen)
    conv_states = torch.randn(SLOTS, channels, WIDTH - 1, generator=gen)
    return x, weight, bias, conv_states


def test_conv_in_pieces_equals_full_sequence_conv() -> None:
    """Pieces shorter than K-1 included: the state must keep older inputs."""
    x, weight, bias, conv_states = _conv_inputs(30)
    expected = _full_causal_conv(x, weight, bias)
    bounds = [0, 1, 3, 8, 9, 10, 12, 25, 26, 30]
    outputs = []
    for start, end in itertools.pairwise(bounds):
        outputs.append(causal_conv1d(x[start:end], weight, bias, conv_states,
                                     *_one(1, start == 0), (0, end - start)))
        # The last K-1 inputs so far, zeros standing in for those before the start.
        padded = torch.cat([torch.zeros(WIDTH - 1, x.shape[1]), x[:end]])
        assert torch.equal(conv_states[1], padded[-(WIDTH - 1):].t())
    torch.testing.assert_close(torch.cat(outputs), expected, **TOL)


def test_conv_mixed_batch_equals_each_sequence_alone() -> None:
    x, weight, _, conv_states = _conv_inputs(20)
    starts, slot_ids, fresh_flags = (0, 2, 3, 14, 20), [4, 1, 0, 2], [True, False, True, False]
    original = conv_states.clone()
    got = causal_conv1d(x, weight, None, conv_states, torch.tensor(slot_ids),
                        torch.tensor(fresh_flags), starts)
    for i, (slot, is_fresh) in enumerate(zip(slot_ids, fresh_flags, strict=True)):
        history = torch.zeros(24, WIDTH - 1) if is_fresh else original[slot]
        window = torch.cat([history.t(), x[starts[i]:starts[i + 1]]])
        expected = _full_causal_conv(window, weight, torch.zeros(24))[WIDTH - 1:]
        torch.testing.assert_close(got[starts[i]:starts[i + 1]], expected, **TOL)
        assert torch.equal(conv_states[slot], window[-(WIDTH - 1):].t())
    assert torch.equal(conv_states[[3, 5]], original[[3, 5]])


# A whole transformers layer, rebuilt from our ops. The projections, the
# gated RMSNorm and out_proj stay outside the ops, as they will in the engine.

def _projections(layer: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """hidden [T, H] -> (mixed q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
    tokens = hidden.shape[0]
    if hasattr(layer, "in_proj_qkvz"):
        # Qwen3-Next groups its outputs per key head: [q, k, v of the group's
        # value heads, z of them], and b/a likewise per key head.
        per_group = HV // HK
        qkvz = F.linear(hidden, layer.in_proj_qkvz.weight).view(tokens, HK, -1)
        q, k, v, z = qkvz.split([DK, DK, per_group * DV, per_group * DV], dim=-1)
        b, a = F.linear(hidden, layer.in_proj_ba.weight).view(tokens, HK, -1).split(
            [per_group, per_group], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)],
                          dim=-1)
        return mixed, z.reshape(tokens, HV, DV), b.reshape(tokens, HV), a.reshape(tokens, HV)
    # Qwen3.5: q|k|v already concatenated, one projection each for z, b, a.
    return (F.linear(hidden, layer.in_proj_qkv.weight),
            F.linear(hidden, layer.in_proj_z.weight).view(tokens, HV, DV),
            F.linear(hidden, layer.in_proj_b.weight), F.linear(hidden, layer.in_proj_a.weight))


def _layer_through_our_ops(layer: torch.nn.Module, hidden: torch.Tensor,
                           conv_states: torch.Tensor, states: torch.Tensor, slot: int,
                           fresh: bool) -> torch.Tensor:
    tokens = hidden.shape[0]
    mixed, z, b, a = _projections(layer, hidden)
    slots, fresh_flags = _one(slot, fresh)
    mixed = causal_conv1d(mixed, layer.conv1d.weight[:, 0], layer.conv1d.bias, conv_states,
                          slots, fresh_flags, (0, tokens))
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    g, beta = gdn_gating(a, b, layer.A_log, layer.dt_bias)
    o = gated_delta_rule(q.view(tokens, HK, DK), k.view(tokens, HK, DK), v.view(tokens, HV, DV),
                         g, beta, states, slots, fresh_flags, (0, tokens), chunk_size=16)
    # Gated RMSNorm per value head: normalise in float32, scale, gate by silu(z).
    o32 = o.float()
    normed = (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + layer.norm.variance_epsilon))
    gated = layer.norm.weight * normed.to(o.dtype) * F.silu(z.float())
    return F.linear(gated.to(o.dtype).reshape(tokens, -1), layer.out_proj.weight)


def _random_layer(family: str) -> torch.nn.Module:
    dims = {"hidden_size": 64, "linear_num_key_heads": HK, "linear_num_value_heads": HV,
            "linear_key_head_dim": DK, "linear_value_head_dim": DV,
            "linear_conv_kernel_dim": WIDTH, "num_hidden_layers": 1,
            "layer_types": ["linear_attention"]}
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
        layer = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**dims), layer_idx=0)
    else:
        from transformers.models.qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
        layer = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**dims), layer_idx=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return layer.eval()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_layer_matches_transformers(family: str) -> None:
    layer = _random_layer(family)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    conv_states = torch.randn(SLOTS, 2 * HK * DK + HV * DV, WIDTH - 1,
                              generator=torch.Generator().manual_seed(2))
    states = _pool(6)
    with torch.no_grad():
        expected = layer(hidden[None])[0]
        one_pass = _layer_through_our_ops(layer, hidden, conv_states, states, 5, True)
        torch.testing.assert_close(one_pass, expected, **TOL)
        # The same prompt in two prefill chunks, then one decode step per token.
        pieces = [(0, 17), (17, 30)] + [(t, t + 1) for t in range(30, 40)]
        stepped = [_layer_through_our_ops(layer, hidden[s:e], conv_states, states, 2, s == 0)
                   for s, e in pieces]
    torch.testing.assert_close(torch.cat(stepped), expected, **TOL)
