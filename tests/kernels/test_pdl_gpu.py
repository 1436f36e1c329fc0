"""Programmatic Dependent Launch on the GPU: chains of our decode kernels
captured with PDL off and on give the bits of the eager chain on fresh
inputs, and only the PDL-on graph has programmatic edges (so the launches
really overlapped). Three chains: a Qwen3-0.6B-shaped dense one
(skinny_linear, rms_norm, silu_and_mul, add_rms_norm), one with packed GGUF
projections (Q4_K on the CUDA-core GEMV, Q8_0 on the tensor-core one) and a
mixture-of-experts block with a shared expert (router, routing, expert GEMV,
combine)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kernels import cuda_build
from kernels.activation import silu_and_mul
from kernels.norm import add_rms_norm, rms_norm
from kernels.skinny_gemm import skinny_linear
from tests.kernels.graph_edges import edge_counts

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
HIDDEN, INTERMEDIATE = 1024, 3072
LAYERS = 3
EPS = 1e-6
# PDL-aware launches of one chain: the first norm, then 4 a layer.
PDL_LAUNCHES = 1 + 4 * LAYERS
# GGUF type ids (gguf.GGMLQuantizationType).
Q8_0, Q4_K = 8, 12


@pytest.fixture
def pdl_on() -> Iterator[None]:
    previous = cuda_build.set_pdl(True)
    yield
    cuda_build.set_pdl(previous)


def _randn(generator: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device="cuda", generator=generator)).to(BF16)


def _chain(x: torch.Tensor, weights: list[dict[str, torch.Tensor]],
           norm: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        # A copy first: the first PDL launch of the graph follows a memcpy
        # node, as in the engine's graphs (graph inputs, embedding).
        residual = x.clone()
        hidden = rms_norm(residual, norm, EPS)
        for layer in weights:
            gated = silu_and_mul(skinny_linear(hidden, layer["gate_up"]))
            down = skinny_linear(gated, layer["down"])
            hidden, residual = add_rms_norm(down, residual, layer["norm"], EPS)
        return hidden
    return run


def _capture(run: Callable[[], torch.Tensor], pdl: bool
             ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    cuda_build.set_pdl(pdl)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = run()
    graph.instantiate()
    return graph, out


def _assert_pdl_graph_gives_eager_bits(run: Callable[[], torch.Tensor], x: torch.Tensor,
                                       pdl_launches: int) -> None:
    """Capture run with PDL off and on; the PDL graph has a programmatic edge
    for every PDL launch after the first, the plain one none; replayed after
    x changes in place, both give the eager run's bits."""
    run()  # compile outside the captures
    torch.cuda.synchronize()
    graphs = {pdl: _capture(run, pdl) for pdl in (False, True)}

    plain_edges, plain_programmatic = edge_counts(graphs[False][0])
    edges, programmatic = edge_counts(graphs[True][0])
    assert plain_edges > 0 and plain_programmatic == 0
    # Every PDL launch whose predecessor is a kernel (all but the first).
    assert programmatic >= pdl_launches - 1, (programmatic, edges)

    for seed in range(1, 6):
        x.copy_(torch.randn(x.shape, device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(seed)))
        expected = run()
        assert torch.isfinite(expected).all(), f"seed {seed}: the eager chain is not finite"
        for pdl, (graph, out) in graphs.items():
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected), f"PDL {'on' if pdl else 'off'}, seed {seed}"


def test_pdl_graph_gives_the_plain_graphs_bits(pdl_on: None) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [{"gate_up": _randn(generator, 2 * INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5),
                "down": _randn(generator, HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5),
                "norm": 1.0 + _randn(generator, HIDDEN, scale=0.1)} for _ in range(LAYERS)]
    norm = 1.0 + _randn(generator, HIDDEN, scale=0.1)
    x = _randn(generator, 1, HIDDEN)
    _assert_pdl_graph_gives_eager_bits(_chain(x, weights, norm), x, PDL_LAUNCHES)


def test_packed_gguf_gemvs_in_a_pdl_graph_give_the_plain_bits(pdl_on: None) -> None:
    """Batch-1 decode MLPs of a packed GGUF model: gate_up in Q4_K through
    the CUDA-core GEMV (the one quant_gemv picks for one row), down in Q8_0
    through the tensor-core GEMV (likewise)."""
    from kernels.gguf_quant import quant_gemv_cuda_cores, quant_gemv_tensor_cores
    from tests.kernels.gguf_blocks import random_packed

    layers = 2
    rng = np.random.default_rng(0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [{"gate_up": torch.from_numpy(random_packed(rng, Q4_K, 2 * INTERMEDIATE,
                                                          HIDDEN)).cuda(),
                "down": torch.from_numpy(random_packed(rng, Q8_0, HIDDEN, INTERMEDIATE)).cuda(),
                "norm": 1.0 + _randn(generator, HIDDEN, scale=0.1)} for _ in range(layers)]
    norm = 1.0 + _randn(generator, HIDDEN, scale=0.1)
    x = _randn(generator, 1, HIDDEN)

    def run() -> torch.Tensor:
        residual = x.clone()
        hidden = rms_norm(residual, norm, EPS)
        for layer in weights:
            gated = silu_and_mul(quant_gemv_cuda_cores(hidden, layer["gate_up"], Q4_K))
            down = quant_gemv_tensor_cores(gated, layer["down"], Q8_0)
            hidden, residual = add_rms_norm(down, residual, layer["norm"], EPS)
        return hidden

    _assert_pdl_graph_gives_eager_bits(run, x, 1 + 4 * layers)


def test_moe_block_in_a_pdl_graph_gives_the_plain_bits(pdl_on: None) -> None:
    """A batch-1 decode step's sparse MLP with a shared expert (Qwen2-MoE's
    shape of block, smaller): router, top-k routing, the expert GEMV's two
    kernels, the shared expert, its gate and the combine."""
    from kernels.moe import moe_experts_gemv, moe_gemv_workspace, moe_route
    from kernels.shared_expert import shared_expert_combine

    experts, top_k, size, shared_size = 64, 8, 768, 512
    generator = torch.Generator(device="cuda").manual_seed(0)
    router = _randn(generator, experts, HIDDEN, scale=HIDDEN**-0.5)
    gate_up = _randn(generator, experts, 2 * size, HIDDEN, scale=HIDDEN**-0.5)
    down = _randn(generator, experts, HIDDEN, size, scale=size**-0.5)
    shared_gate_up = _randn(generator, 2 * shared_size, HIDDEN, scale=HIDDEN**-0.5)
    shared_down = _randn(generator, HIDDEN, shared_size, scale=shared_size**-0.5)
    shared_gate = _randn(generator, 1, HIDDEN, scale=HIDDEN**-0.5)
    norms = [1.0 + _randn(generator, HIDDEN, scale=0.1) for _ in range(2)]
    workspace = moe_gemv_workspace(top_k, size, "cuda")
    x = _randn(generator, 1, HIDDEN)

    def run() -> torch.Tensor:
        residual = x.clone()
        hidden = rms_norm(residual, norms[0], EPS)
        weights, ids = moe_route(skinny_linear(hidden, router), top_k, True)
        routed = moe_experts_gemv(hidden, gate_up, down, ids, weights, workspace=workspace)
        shared = skinny_linear(silu_and_mul(skinny_linear(hidden, shared_gate_up)), shared_down)
        combined = shared_expert_combine(routed, shared, skinny_linear(hidden, shared_gate),
                                         out=shared)
        return add_rms_norm(combined, residual, norms[1], EPS)[0]

    # rms_norm, router, route, 2 expert kernels, 3 shared-expert, gate,
    # combine, add_rms_norm.
    _assert_pdl_graph_gives_eager_bits(run, x, 11)
