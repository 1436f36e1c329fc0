"""The hybrid models' norm kernels against kernels.hybrid_reference (torch on the GPU).

kernels/norm.py's zero-centred variants (Qwen3-Next's / Qwen3.5's layer and
final norms, with and without the fused residual add) and kernels/gated_norm.py
(the Gated DeltaNet output norm). The kernels do torch's float32 steps in
torch's order; only the variance's sum runs in another order. Two kinds of
inputs therefore:
- "grid" inputs, multiples of 1/8 below 2 in magnitude, whose squares sum
  exactly in float32 in any order: the kernels must then be bitwise equal to
  the reference (the gated norm's silu: within one ulp, see there);
- random normal inputs: equal but for a tiny fraction of elements, each at
  most an ulp or two off, and close to a float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from kernels import hybrid_reference, reference

pytestmark = pytest.mark.gpu

EPS = 1e-6
HIDDEN = [2048, 4096, 1024, 16384]  # Qwen3.5 / Qwen3-Next widths, a warp-row width, the widest
TOKENS = [1, 7, 300]


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns mapped to integers that step by one per ulp across zero."""
    bits = x.contiguous().view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_nearly_bitwise(out: torch.Tensor, ref: torch.Tensor, max_ulps: int) -> None:
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN elements"
    ulps = (ordered_bits(out) - ordered_bits(ref)).abs()
    differing = int((ulps > 0).sum())
    assert differing <= 2 + 1e-3 * out.numel(), f"{differing} of {out.numel()} elements differ"
    assert int(ulps.max()) <= max_ulps, f"an element is {int(ulps.max())} ulps off"


def assert_close_to_float64(out: torch.Tensor, exact: torch.Tensor) -> None:
    error = (out.double() - exact).norm() / exact.norm()
    assert error < 1e-2, f"relative error {error:.2e}"


def grid_values(*shape: int, seed: int) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2): exact in bf16 (sums of two too), their
    squares' partial sums exact in float32 in any order (at most 2^14 of them,
    each a multiple of 2^-6 up to 4: below 2^16 in steps of 2^-6, 22 bits)."""
    whole = torch.randint(-16, 16, shape, device="cuda", generator=gen(seed))
    return (whole.float() / 8).to(torch.bfloat16)


def normal_values(*shape: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda", generator=gen(seed)) * scale).to(torch.bfloat16)


def zero_centred_weight(size: int, seed: int) -> torch.Tensor:
    # Checkpoints store these near 0 (the scale is 1 + w).
    return (0.1 * torch.randn(size, device="cuda", generator=gen(seed))).to(torch.bfloat16)


def zc_float64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * (1 + weight.double())


# --- zero-centred RMSNorm (kernels/norm.py, zero_centred=True) ---------------------------


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_zero_centred_rms_norm_is_the_reference(tokens: int, hidden: int) -> None:
    from kernels.norm import rms_norm

    weight = zero_centred_weight(hidden, seed=hidden)
    x = grid_values(tokens, hidden, seed=tokens * 7 + hidden)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, weight, EPS, out=out, zero_centred=True) is out
    torch.cuda.synchronize()
    assert torch.equal(out, hybrid_reference.zero_centred_rms_norm(x, weight, EPS))

    x = normal_values(tokens, hidden, seed=tokens * 11 + hidden)
    out = rms_norm(x, weight, EPS, zero_centred=True)
    torch.cuda.synchronize()
    # One rounding at the end: a variance summed in another order moves an
    # element by at most one ulp.
    assert_nearly_bitwise(out, hybrid_reference.zero_centred_rms_norm(x, weight, EPS), 1)
    assert_close_to_float64(out, zc_float64(x, weight))


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_zero_centred_rms_norm_is_the_reference(tokens: int, hidden: int) -> None:
    from kernels.norm import add_rms_norm

    weight = zero_centred_weight(hidden, seed=hidden + 1)
    # Grid values summed stay on the 1/8 grid below 4: exact in bf16, and
    # their squares still sum exactly.
    x, residual = (grid_values(tokens, hidden, seed=tokens * 13 + hidden + i) for i in (0, 1))
    ref_out, ref_summed = hybrid_reference.add_zero_centred_rms_norm(x, residual.clone(),
                                                                     weight, EPS)
    x_before = x.clone()
    out, new_residual = add_rms_norm(x, residual, weight, EPS, zero_centred=True)
    torch.cuda.synchronize()
    assert new_residual is residual and torch.equal(x, x_before)
    assert torch.equal(residual, ref_summed)
    assert torch.equal(out, ref_out)

    x, residual = (normal_values(tokens, hidden, seed=tokens * 17 + hidden + i) for i in (0, 1))
    ref_out, ref_summed = hybrid_reference.add_zero_centred_rms_norm(x, residual.clone(),
                                                                     weight, EPS)
    out, _ = add_rms_norm(x, residual, weight, EPS, zero_centred=True)
    torch.cuda.synchronize()
    # The residual add is torch's bf16 add, bitwise, whatever the inputs.
    assert torch.equal(residual, ref_summed)
    assert_nearly_bitwise(out, ref_out, 1)
    assert_close_to_float64(out, zc_float64(ref_summed, weight))


def test_one_plus_weight_stays_float32() -> None:
    """(1 + w) in float32, not a bf16 weight with 1 pre-added (that rounds w
    to 2^-8 steps): with weights that such a shortcut changes, the kernel
    must still give the reference's bits."""
    from kernels.norm import rms_norm

    hidden = 2048
    weight = (torch.rand(hidden, device="cuda", generator=gen(5)) * 0.02 + 0.001).to(
        torch.bfloat16)
    x = grid_values(9, hidden, seed=6)
    expected = hybrid_reference.zero_centred_rms_norm(x, weight, EPS)
    shortcut = hybrid_reference.zero_centred_rms_norm(x, (1 + weight).to(torch.bfloat16) - 1,
                                                      EPS)
    assert not torch.equal(expected, shortcut), "the weights must tell the two apart"
    assert torch.equal(rms_norm(x, weight, EPS, zero_centred=True), expected)


def test_plain_rms_norm_unchanged_beside_the_zero_centred_one() -> None:
    from kernels.norm import add_rms_norm, rms_norm

    x, residual = (grid_values(7, 4096, seed=20 + i) for i in (0, 1))
    weight = (1 + zero_centred_weight(4096, seed=22)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    ref_out, ref_summed = reference.add_rms_norm(x, residual.clone(), weight, EPS)
    out, summed = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, ref_summed) and torch.equal(out, ref_out)


def test_zero_centred_out_may_be_x_and_graphs_replay() -> None:
    from kernels.norm import add_rms_norm, rms_norm

    hidden = 2048
    weight = zero_centred_weight(hidden, seed=30)
    x = grid_values(5, hidden, seed=31)
    expected = hybrid_reference.zero_centred_rms_norm(x, weight, EPS)
    rms_norm(x, weight, EPS, out=x, zero_centred=True)
    assert torch.equal(x, expected)

    x, residual = grid_values(8, hidden, seed=32), grid_values(8, hidden, seed=33)
    normed, out = torch.empty_like(x), torch.empty_like(x)
    rms_norm(x, weight, EPS, out=normed, zero_centred=True)  # compile outside the capture
    add_rms_norm(normed, residual.clone(), weight, EPS, out=out, zero_centred=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm(x, weight, EPS, out=normed, zero_centred=True)
        add_rms_norm(normed, residual, weight, EPS, out=out, zero_centred=True)
    for seed in (34, 35):
        new_x, new_residual = grid_values(8, hidden, seed=seed), grid_values(8, hidden, seed=seed + 100)
        x.copy_(new_x)
        residual.copy_(new_residual)
        normed.fill_(float("nan"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_normed = hybrid_reference.zero_centred_rms_norm(new_x, weight, EPS)
        assert torch.equal(normed, ref_normed)
        ref_out, ref_summed = hybrid_reference.add_zero_centred_rms_norm(
            ref_normed, new_residual, weight, EPS)
        assert torch.equal(residual, ref_summed)
        # normed is off the 1/8 grid: the second norm's variance is not exact.
        assert_nearly_bitwise(out, ref_out, 1)


# --- gated RMSNorm (kernels/gated_norm.py) -------------------------------------------------


def projection_gate(tokens: int, heads: int, head_dim: int, grouped: bool,
                    seed: int) -> torch.Tensor:
    """z as GatedDeltaNet._split leaves it: a strided view into the in_proj
    output (Qwen3.5: one z block after q|k|v; Qwen3-Next: per key head)."""
    if not grouped:
        width = 3 * heads * head_dim + 2 * heads  # q|k (smaller in truth), v, z, b, a
        projected = normal_values(tokens, width, seed=seed)
        start = 2 * heads * head_dim
        z = projected[:, start:start + heads * head_dim]
        return z.reshape(tokens, heads, head_dim)
    key_heads, per_head = 2, heads // 2
    group = 2 * 128 + 2 * per_head * head_dim  # q, k (128 each), v, z of a key head
    projected = normal_values(tokens, key_heads * group + 2 * heads, seed=seed)
    qkvz = projected[:, :key_heads * group].reshape(tokens, key_heads, group)
    z = qkvz[..., 256 + per_head * head_dim:]
    return z.reshape(tokens, heads, head_dim)


def gated_float64(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64, g64 = x.double(), gate.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    return weight.double() * normed * g64 * torch.sigmoid(g64)


@pytest.mark.parametrize("grouped", [False, True], ids=["qwen3.5_z", "qwen3_next_z"])
@pytest.mark.parametrize(("heads", "head_dim"), [(32, 128), (16, 128), (8, 64), (4, 256)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_gated_rms_norm_matches_the_reference(tokens: int, heads: int, head_dim: int,
                                              grouped: bool) -> None:
    from kernels.gated_norm import gated_norm_supported, gated_rms_norm

    gate = projection_gate(tokens, heads, head_dim, grouped, seed=tokens + heads + head_dim)
    # Qwen3.5's z is a strided view of the projection (one token's is
    # contiguous anyway); Qwen3-Next's is regrouped per key head, a copy.
    assert gate.is_contiguous() == (grouped or tokens == 1)
    assert gated_norm_supported(gate.contiguous(), gate)
    gate_before = gate.clone()
    weight = (1 + 0.3 * torch.randn(head_dim, device="cuda", generator=gen(1))).to(
        torch.bfloat16)
    # silu's expf may differ from torch's in float32's last bit, and the
    # product round apart: one ulp at most, rarely. Otherwise torch's steps.
    x = grid_values(tokens, heads, head_dim, seed=tokens * 3 + heads)
    out = torch.full_like(x, float("nan"))
    assert gated_rms_norm(x, gate, weight, EPS, out=out) is out
    torch.cuda.synchronize()
    assert torch.equal(gate, gate_before)
    assert_nearly_bitwise(out, hybrid_reference.gated_rms_norm(x, gate, weight, EPS), 1)

    x = normal_values(tokens, heads, head_dim, seed=tokens * 5 + heads)
    out = gated_rms_norm(x, gate, weight, EPS)
    torch.cuda.synchronize()
    # A normalized value one ulp apart (variance order) can move the bf16
    # weight product, and then the gated product, by up to two ulps.
    assert_nearly_bitwise(out, hybrid_reference.gated_rms_norm(x, gate, weight, EPS), 2)
    assert_close_to_float64(out, gated_float64(x, gate, weight))


def test_gated_rms_norm_in_a_graph_and_bad_inputs() -> None:
    from kernels.gated_norm import gated_norm_supported, gated_rms_norm

    gate = projection_gate(7, 32, 128, False, seed=40)
    weight = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    x = grid_values(7, 32, 128, seed=41)
    out = torch.empty_like(x)
    gated_rms_norm(x, gate, weight, EPS, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gated_rms_norm(x, gate, weight, EPS, out=out)
    x.copy_(grid_values(7, 32, 128, seed=42))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_nearly_bitwise(out, hybrid_reference.gated_rms_norm(x, gate, weight, EPS), 1)

    assert not gated_norm_supported(x, gate[:, :, 1:65].contiguous())  # shape
    assert not gated_norm_supported(x[:, :, :96].contiguous(), gate[:, :, :96])  # head size
    odd = normal_values(7, 32 * 128 + 1, seed=43)[:, 1:].view(7, 32, 128)  # 2 bytes off
    assert not gated_norm_supported(x, odd)
    for call in (
        lambda: gated_rms_norm(x.float(), gate, weight, EPS),
        lambda: gated_rms_norm(x, odd, weight, EPS),
        lambda: gated_rms_norm(x, gate, weight[:64], EPS),
        lambda: gated_rms_norm(x, gate, weight, EPS, out=x),
        lambda: gated_rms_norm(x[:, :, :96].contiguous(), gate[:, :, :96], weight[:96], EPS),
    ):
        with pytest.raises(ValueError):
            call()
    empty = torch.empty(0, 32, 128, device="cuda", dtype=torch.bfloat16)
    assert gated_rms_norm(empty, empty, weight, EPS).shape == (0, 32, 128)
