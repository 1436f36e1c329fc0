"""kernels.skinny_fused against the unfused chains of our kernels: the same
bits (the fused kernels repeat rms_norm's sums in its order and round where
silu_and_mul and torch's bf16 add round), for every row count 1..8, the
decode shapes and odd ones (partial row groups, K off the 128 step, both of
norm.cu's row layouts: warp rows up to K = 1024, block rows above), and in
a CUDA graph with Programmatic Dependent Launch as the decode graphs run
them. Where the SwiGLU kernel's K split differs from the unfused GEMM's
(many K steps over few rows), it is checked against float64 instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cuda_build
from kernels.activation import silu_and_mul
from kernels.norm import rms_norm
from kernels.skinny_fused import (
    norm_skinny_linear,
    norm_skinny_swiglu,
    skinny_linear_add_,
    swiglu_layout,
)
from kernels.skinny_gemm import _layout, skinny_linear
from tests.kernels.graph_edges import edge_counts

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
EPS = 1e-6
# (N, K): Qwen3-0.6B's QKV / o / gate_up / down, the 8B's QKV and o, odd ones;
# K 2048 and 5120 take norm.cu's block rows (2 and 4 vectors a thread).
NORM_SHAPES = [(4096, 1024), (6144, 4096), (1000, 1024), (9, 576), (33, 24), (4097, 264),
               (2056, 2048), (300, 5120), (1, 8)]
ADD_SHAPES = [(1024, 2048), (1024, 3072), (4096, 4096), (1000, 1024), (9, 576), (33, 24),
              (4352, 64), (1, 8)]
# (I, K): gate_up is [2I, K].
SWIGLU_SHAPES = [(3072, 1024), (12288, 4096), (1536, 576), (100, 1024), (7, 24), (4, 8),
                 (260, 2048)]


def _randn(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(*shape, device="cuda", generator=generator)).to(BF16)


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different scales, so a swapped row or a shared scale shows."""
    scale = torch.linspace(0.5, 4.0, rows, device="cuda").unsqueeze(1)
    return (_randn(seed, rows, k).float() * scale).to(BF16)


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize(("n", "k"), NORM_SHAPES)
def test_norm_linear_gives_the_unfused_bits(rows: int, n: int, k: int) -> None:
    x = _x(rows, k, 1)
    norm_weight = 1.0 + _randn(2, k, scale=0.1)
    weight = _randn(3, n, k, scale=k**-0.5)
    bias = _randn(4, n, scale=0.5)
    for b in (None, bias):
        expected = skinny_linear(rms_norm(x, norm_weight, EPS), weight, b)
        out = torch.full_like(expected, float("nan"))
        norm_skinny_linear(x, norm_weight, EPS, weight, b, out=out)
        assert torch.equal(out, expected), f"bias {b is not None}"


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize(("n", "k"), ADD_SHAPES)
def test_linear_add_gives_the_unfused_bits(rows: int, n: int, k: int) -> None:
    x = _x(rows, k, 5)
    weight = _randn(6, n, k, scale=k**-0.5)
    bias = _randn(7, n, scale=0.5)
    residual = _x(rows, n, 8)
    for b in (None, bias):
        expected = residual + skinny_linear(x, weight, b)
        stream = residual.clone()
        assert skinny_linear_add_(x, weight, b, stream) is stream
        assert torch.equal(stream, expected), f"bias {b is not None}"


def _split_matches(intermediate: int, k: int, sms: int) -> bool:
    """Whether the SwiGLU kernel splits K as skinny_linear on [2I, K] does."""
    _, warps, steps = swiglu_layout(intermediate, k)
    _, _, plain_warps, plain_steps = _layout(2 * intermediate, k, sms)
    return (warps, steps) == (plain_warps, plain_steps)


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize(("intermediate", "k"), SWIGLU_SHAPES)
def test_norm_swiglu_gives_the_unfused_bits(rows: int, intermediate: int, k: int) -> None:
    x = _x(rows, k, 9)
    norm_weight = 1.0 + _randn(10, k, scale=0.1)
    gate_up = _randn(11, 2 * intermediate, k, scale=k**-0.5)
    out = torch.full((rows, intermediate), float("nan"), dtype=BF16, device="cuda")
    norm_skinny_swiglu(x, norm_weight, EPS, gate_up, out=out)
    normed = rms_norm(x, norm_weight, EPS)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (silu_and_mul takes I a multiple of 8 only.)
    if intermediate % 8 == 0 and _split_matches(intermediate, k, sms):
        assert torch.equal(out, silu_and_mul(skinny_linear(normed, gate_up)))
        return
    projected = F.linear(normed.double(), gate_up.double())
    gate, up = projected[:, :intermediate], projected[:, intermediate:]
    exact = F.silu(gate) * up
    error = (out.double() - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(error.max()) < 1e-2, error.tolist()


def test_the_swiglu_shapes_check_both_ways() -> None:
    # The exact comparison covers the decode shapes; the float64 one is
    # reached too (so a wrong pairing of gate and up rows cannot hide).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    matches = [i % 8 == 0 and _split_matches(i, k, sms) for i, k in SWIGLU_SHAPES]
    assert matches[0] and matches[1] and not all(matches)


def test_refuses_what_it_cannot_take() -> None:
    x = _x(2, 64, 0)
    norm_weight = _randn(1, 64)
    with pytest.raises(ValueError, match="norm_weight"):
        norm_skinny_linear(x, _randn(1, 32), EPS, _randn(2, 16, 64))
    with pytest.raises(ValueError, match="even"):
        norm_skinny_swiglu(x, norm_weight, EPS, _randn(2, 15, 64))
    with pytest.raises(ValueError, match="rows"):
        norm_skinny_linear(_x(9, 64, 0), norm_weight, EPS, _randn(2, 16, 64))
    with pytest.raises(ValueError, match="normalized rows"):  # 262 KB of shared memory
        norm_skinny_linear(_x(8, 16384, 0), _randn(1, 16384), EPS, _randn(2, 16, 16384))
    with pytest.raises(ValueError, match="overlap"):
        stream = _x(2, 64, 0)
        skinny_linear_add_(stream, _randn(2, 64, 64), None, stream)


def test_fused_layer_chain_in_a_pdl_graph_gives_the_eager_bits() -> None:
    """Three Qwen3-0.6B-shaped dense layers (attention left out) as the
    fused dataflow runs them, captured with PDL on: the replay on fresh
    inputs gives the eager bits, and every launch after the first has a
    programmatic edge."""
    hidden, intermediate = 1024, 3072
    layers = [{"qkv": _randn(20 + i, 4096, hidden, scale=hidden**-0.5),
               # o over all of QKV: no copy kernel between the PDL launches.
               "o": _randn(30 + i, hidden, 4096, scale=4096**-0.5),
               "gate_up": _randn(40 + i, 2 * intermediate, hidden, scale=hidden**-0.5),
               "down": _randn(50 + i, hidden, intermediate, scale=intermediate**-0.5),
               "norms": (1.0 + _randn(60 + i, hidden, scale=0.1),
                         1.0 + _randn(70 + i, hidden, scale=0.1))} for i in range(3)]
    x = _x(1, hidden, 80)

    def run() -> torch.Tensor:
        stream = x.clone()
        for layer in layers:
            qkv = norm_skinny_linear(stream, layer["norms"][0], EPS, layer["qkv"])
            skinny_linear_add_(qkv, layer["o"], None, stream)
            gated = norm_skinny_swiglu(stream, layer["norms"][1], EPS, layer["gate_up"])
            skinny_linear_add_(gated, layer["down"], None, stream)
        return stream

    run()
    torch.cuda.synchronize()
    previous = cuda_build.set_pdl(True)
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            out = run()
        graph.instantiate()
    finally:
        cuda_build.set_pdl(previous)
    _, programmatic = edge_counts(graph)
    assert programmatic >= 4 * len(layers) - 1
    for seed in range(81, 84):
        x.copy_(_x(1, hidden, seed))
        expected = run()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), seed
