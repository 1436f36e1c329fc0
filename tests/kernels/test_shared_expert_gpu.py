"""kernels/shared_expert.py (routed + sigmoid(gate) * shared) against torch's ops."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def inputs(tokens: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    routed, shared = (torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
                      for _ in range(2))
    logit = (torch.randn(tokens, 1, device="cuda", generator=g) * 4).to(torch.bfloat16)
    return routed, shared, logit


@pytest.mark.parametrize("hidden", [2048, 4096, 8])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("out_is", ["new", "shared", "routed"])
def test_matches_torch(tokens: int, hidden: int, out_is: str) -> None:
    from kernels.shared_expert import combine_supported, shared_expert_combine

    routed, shared, logit = inputs(tokens, hidden, seed=tokens * 31 + hidden)
    expected = routed + torch.sigmoid(logit) * shared
    assert combine_supported(routed, shared, logit)
    out = {"new": torch.full_like(routed, float("nan")), "shared": shared,
           "routed": routed}[out_is]
    assert shared_expert_combine(routed, shared, logit, out=out) is out
    torch.cuda.synchronize()
    assert not out.isnan().any()
    # torch's three roundings in its order. expf against torch's exp may
    # differ in float32's last bit and flip the sigmoid's bf16 rounding (one
    # ulp, relative 2^-8), which moves the sum by at most 2 ulps, rarely.
    ulps = (ordered_bits(out) - ordered_bits(expected)).abs()
    assert int((ulps > 0).sum()) <= 2 + 1e-3 * out.numel()
    assert int(ulps.max()) <= 2


def test_the_gate_is_per_token_and_graphs_replay() -> None:
    from kernels.shared_expert import shared_expert_combine

    routed, shared, logit = inputs(5, 2048, seed=1)
    logit.copy_(torch.tensor([[-30.0], [30.0], [0.0], [2.0], [-2.0]]))
    out = shared_expert_combine(routed, shared, logit)
    torch.cuda.synchronize()
    assert torch.equal(out[0], routed[0])  # sigmoid(-30) rounds to ~1e-13: shared vanishes
    assert torch.equal(out[1], routed[1] + shared[1])  # sigmoid(30) is 1 in bf16
    assert torch.equal(out[2], routed[2] + 0.5 * shared[2])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        shared_expert_combine(routed, shared, logit, out=out)
    new = inputs(5, 2048, seed=2)
    for tensor, value in zip((routed, shared, logit), new, strict=True):
        tensor.copy_(value)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = routed + torch.sigmoid(logit) * shared
    assert int((ordered_bits(out) - ordered_bits(expected)).abs().max()) <= 2


def test_bad_inputs_raise() -> None:
    from kernels.shared_expert import combine_supported, shared_expert_combine

    routed, shared, logit = inputs(4, 2048, seed=3)
    assert not combine_supported(routed, shared[:2], logit)
    assert not combine_supported(routed.float(), shared, logit)
    for call in (
        lambda: shared_expert_combine(routed, shared[:2], logit),
        lambda: shared_expert_combine(routed, shared, logit[:2]),
        lambda: shared_expert_combine(routed[:, :12].contiguous(), shared[:, :12].contiguous(),
                                      logit),
        lambda: shared_expert_combine(routed, shared, logit.float()),
        lambda: shared_expert_combine(routed, shared, logit, out=routed[:2]),
    ):
        with pytest.raises(ValueError):
            call()
