"""The torch mixture-of-experts reference: routing as transformers routes, the
per-expert loop against a plain per-token sum, and the graph-safe dense form
against the loop (to float rounding: GEMMs over different row counts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe_reference import moe_experts, route_topk

TOKENS, HIDDEN, SIZE, EXPERTS, TOP_K = 13, 32, 16, 8, 2


def _experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * SIZE, HIDDEN, generator=gen) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, SIZE, generator=gen) * 0.2
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    return hidden, gate_up, down, logits


@pytest.mark.parametrize("normalize", [False, True])
def test_routing_matches_transformers_router(normalize: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            norm_topk_prob=normalize)
    router = Qwen3MoeTopKRouter(config)
    hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(2))
        # Two identical rows: every token sees a tie between experts 3 and 6.
        router.weight[6] = router.weight[3]
        _, hf_weights, hf_experts = router(hidden)
        weights, experts = route_topk(F.linear(hidden, router.weight), TOP_K, normalize)
    assert torch.equal(experts, hf_experts)
    assert torch.equal(weights, hf_weights)


def test_expert_loop_equals_per_token_sum() -> None:
    hidden, gate_up, down, logits = _experts()
    weights, experts = route_topk(logits, TOP_K, normalize=True)
    expected = torch.zeros_like(hidden)
    for token in range(TOKENS):
        for slot in range(TOP_K):
            e = int(experts[token, slot])
            gate, up = F.linear(hidden[token], gate_up[e]).chunk(2)
            expected[token] += weights[token, slot] * F.linear(F.silu(gate) * up, down[e])
    got = moe_experts(hidden, gate_up, down, experts, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_unpicked_experts_are_not_computed() -> None:
    """Only experts some token picked run (an expert full of NaN, never picked,
    leaves no trace)."""
    hidden, gate_up, down, logits = _experts(seed=5)
    logits[:, EXPERTS - 1] = -1e9
    gate_up[EXPERTS - 1] = float("nan")
    weights, experts = route_topk(logits, TOP_K, normalize=True)
    assert not torch.isnan(moe_experts(hidden, gate_up, down, experts, weights)).any()
