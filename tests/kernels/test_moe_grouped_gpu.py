"""kernels.moe_grouped.moe_experts_grouped on the GPU (bf16, SwiGLU kernel)
against the torch reference loop and a float64 computation from the same
inputs, at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes; then captured in
a CUDA graph with static inputs and replayed with new routing copied in, which
must give the eager call's output bit for bit (the proof that nothing reads
the routing back to the host and no shape depends on it).

torch._grouped_mm keeps its offsets on the device only for bf16 on sm90/sm100
(the H200 is sm90); elsewhere it falls back to a host loop and capture fails.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
# name: (H, I, E, k)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


def _stacks(hidden: int, size: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(experts, 2 * size, hidden, device="cuda", generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, size, device="cuda", generator=gen) / size**0.5
    return gate_up.to(BF16), down.to(BF16)


def _inputs(tokens: int, hidden: int, experts: int, top_k: int, seed: int,
            weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernels.moe_reference import route_topk

    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.linspace(0.5, 3.0, tokens, device="cuda").unsqueeze(1)
    x = (torch.randn(tokens, hidden, device="cuda", generator=gen) * scale).to(BF16)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = route_topk(logits, top_k, normalize=True)
    return x, ids, weights.to(weight_dtype)


def _grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    from kernels.activation import silu_and_mul
    from kernels.moe_grouped import moe_experts_grouped

    return moe_experts_grouped(x, gate_up, down, ids, weights, silu_and_mul=silu_and_mul)


def _assert_rows_within(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    assert not got.isnan().any(), f"{what}: NaN in the output"
    error = (got.double() - want.double()).norm(dim=1) / want.double().norm(dim=1)
    assert float(error.max()) < bound, f"{what}: worst per-row relative error {float(error.max()):.2e}"


def _check_against_references(got: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor,
                              down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                              what: str) -> None:
    from kernels.moe_reference import moe_experts

    loop = moe_experts(x, gate_up, down, ids, weights)
    exact = moe_experts(x.double(), gate_up.double(), down.double(), ids, weights.double())
    _assert_rows_within(got, exact, 1e-2, f"{what} vs float64")
    _assert_rows_within(got, loop, 2e-2, f"{what} vs torch loop")


@pytest.mark.parametrize("weight_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_reference_on_cuda(shape: str, tokens: int, weight_dtype: torch.dtype) -> None:
    hidden, size, experts, top_k = SHAPES[shape]
    gate_up, down = _stacks(hidden, size, experts, seed=1)
    x, ids, weights = _inputs(tokens, hidden, experts, top_k, seed=tokens, weight_dtype=weight_dtype)
    got = _grouped(x, gate_up, down, ids, weights)
    assert got.dtype == BF16 and got.shape == x.shape
    _check_against_references(got, x, gate_up, down, ids, weights, f"{shape} T={tokens}")


def test_no_host_sync() -> None:
    """Eagerly too, nothing waits on the device (a .item(), bincount or nonzero would)."""
    hidden, size, experts, top_k = SHAPES["qwen3-30b-a3b"]
    gate_up, down = _stacks(hidden, size, experts, seed=2)
    x, ids, weights = _inputs(64, hidden, experts, top_k, seed=3, weight_dtype=BF16)
    _grouped(x, gate_up, down, ids, weights)  # compile the SwiGLU kernel first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _grouped(x, gate_up, down, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("weight_dtype", [torch.float32, BF16])
@pytest.mark.parametrize(("shape", "tokens"), [("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 256),
                                               ("mixtral-8x7b", 48)])
def test_cuda_graph_replay_with_new_routing(shape: str, tokens: int,
                                            weight_dtype: torch.dtype) -> None:
    hidden, size, experts, top_k = SHAPES[shape]
    gate_up, down = _stacks(hidden, size, experts, seed=4)
    x, ids, weights = _inputs(tokens, hidden, experts, top_k, seed=5, weight_dtype=weight_dtype)
    _grouped(x, gate_up, down, ids, weights)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _grouped(x, gate_up, down, ids, weights)

    routings = [_inputs(tokens, hidden, experts, top_k, seed=s, weight_dtype=weight_dtype)
                for s in (6, 7)]
    # Every token on the same k experts: one or two full groups, the rest empty.
    same_x, _, same_weights = _inputs(tokens, hidden, experts, top_k, seed=8,
                                      weight_dtype=weight_dtype)
    same_ids = torch.arange(top_k, device="cuda").flip(0).expand(tokens, top_k).contiguous()
    routings.append((same_x, same_ids, same_weights))
    for step, (new_x, new_ids, new_weights) in enumerate(routings):
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = _grouped(new_x, gate_up, down, new_ids, new_weights)
        assert torch.equal(out, eager), f"replay {step} differs from the eager call"
        _check_against_references(out, new_x, gate_up, down, new_ids, new_weights,
                                   f"replay {step}")
