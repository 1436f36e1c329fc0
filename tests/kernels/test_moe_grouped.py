"""kernels.moe_grouped.moe_experts_grouped against the torch reference loop
(kernels.moe_reference.moe_experts) on the CPU: routings with empty experts,
every token on one expert, k == E, weights in float32 (Mixtral) and in the
model dtype (Qwen3-MoE)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe_grouped import moe_experts_grouped
from kernels.moe_reference import moe_experts, route_topk

HIDDEN, SIZE = 32, 16
BF16 = torch.bfloat16
# (model dtype, routing weights dtype): Mixtral weighs in float32, Qwen3-MoE in the model dtype.
DTYPES = [(torch.float32, torch.float32), (BF16, BF16), (BF16, torch.float32)]


def _stacks(num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * SIZE, HIDDEN, generator=gen) * 0.3
    down = torch.randn(num_experts, HIDDEN, SIZE, generator=gen) * 0.3
    return gate_up, down


def _hidden(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of different scales, so a token's output landing on another's row shows.
    scale = torch.linspace(0.5, 3.0, tokens).unsqueeze(1)
    return torch.randn(tokens, HIDDEN, generator=gen) * scale


def _routing(tokens: int, num_experts: int, top_k: int, seed: int,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    return route_topk(logits, top_k, normalize=True)


def _exact(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per (token, slot) in float64 from the same (rounded) inputs."""
    hidden, gate_up, down, weights = (t.double() for t in (hidden, gate_up, down, weights))
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for slot in range(experts.shape[1]):
            e = int(experts[token, slot])
            gate, up = F.linear(hidden[token], gate_up[e]).chunk(2)
            out[token] += weights[token, slot] * F.linear(F.silu(gate) * up, down[e])
    return out


def _assert_rows_within(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    error = (got.double() - want.double()).norm(dim=1) / want.double().norm(dim=1)
    assert float(error.max()) < bound, f"{what}: per-row relative error {error.tolist()}"


def _check(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           experts: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
           weight_dtype: torch.dtype) -> None:
    hidden, gate_up, down = (t.to(dtype) for t in (hidden, gate_up, down))
    weights = weights.to(weight_dtype)
    got = moe_experts_grouped(hidden, gate_up, down, experts, weights)
    want = moe_experts(hidden, gate_up, down, experts, weights)
    assert got.dtype == dtype and got.shape == hidden.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    # bf16: both round the GEMMs and SwiGLU alike; the reference also rounds
    # every add, so each is within bf16 rounding of the exact sum, not equal.
    exact = _exact(hidden, gate_up, down, experts, weights)
    _assert_rows_within(got, exact, 1e-2, "grouped vs exact")
    _assert_rows_within(got, want, 2e-2, "grouped vs reference loop")


@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_experts", [4, 16, 128])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_matches_reference_loop(tokens: int, num_experts: int, top_k: int,
                                dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    if top_k > num_experts:
        pytest.skip("k > E is no routing")
    gate_up, down = _stacks(num_experts, seed=tokens + num_experts)
    weights, experts = _routing(tokens, num_experts, top_k, seed=top_k)
    _check(_hidden(tokens, seed=3), gate_up, down, experts, weights, dtype, weight_dtype)


@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_on_the_same_experts(top_k: int, dtype: torch.dtype,
                                         weight_dtype: torch.dtype) -> None:
    """One group holds every row (or two groups every row), the rest are empty."""
    tokens, num_experts = 17, 16
    gate_up, down = _stacks(num_experts, seed=7)
    experts = torch.tensor([[9, 2][:top_k]] * tokens)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(8)) + 0.1
    _check(_hidden(tokens, seed=9), gate_up, down, experts, weights, dtype, weight_dtype)


@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
@pytest.mark.parametrize("num_experts", [1, 4, 8])
def test_every_token_picks_every_expert(num_experts: int, dtype: torch.dtype,
                                        weight_dtype: torch.dtype) -> None:
    gate_up, down = _stacks(num_experts, seed=10)
    weights, experts = _routing(17, num_experts, num_experts, seed=11)
    _check(_hidden(17, seed=12), gate_up, down, experts, weights, dtype, weight_dtype)


def test_slots_in_any_expert_order() -> None:
    """A token's slots need not be sorted by expert, nor the tokens: the sort
    by expert and the un-permutation put every output back on its own row."""
    tokens, num_experts = 6, 8
    gate_up, down = _stacks(num_experts, seed=13)
    experts = torch.tensor([[7, 0], [0, 7], [3, 1], [1, 3], [7, 3], [0, 1]])
    weights = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5], [0.3, 0.7], [0.6, 0.4], [1.0, 0.0]])
    hidden = _hidden(tokens, seed=14)
    got = moe_experts_grouped(hidden, gate_up, down, experts, weights)
    torch.testing.assert_close(got, _exact(hidden, gate_up, down, experts, weights).float(),
                               rtol=1e-5, atol=1e-6)


def test_unpicked_experts_are_not_computed() -> None:
    """An expert full of NaN that no token picks leaves no trace: its group is empty."""
    gate_up, down = _stacks(16, seed=15)
    logits = torch.randn(17, 16, generator=torch.Generator().manual_seed(16))
    logits[:, 5] = -1e9
    gate_up[5] = float("nan")
    down[5] = float("nan")
    weights, experts = route_topk(logits, 2, normalize=True)
    assert not torch.isnan(moe_experts_grouped(_hidden(17, seed=17), gate_up, down,
                                               experts, weights)).any()


def test_custom_silu_and_mul_is_used() -> None:
    """The activation is a parameter (the GPU passes its kernel): a different
    one changes the result."""
    gate_up, down = _stacks(4, seed=18)
    weights, experts = _routing(5, 4, 2, seed=19)
    hidden = _hidden(5, seed=20)

    def doubled(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return 2 * F.silu(gate) * up

    plain = moe_experts_grouped(hidden, gate_up, down, experts, weights)
    twice = moe_experts_grouped(hidden, gate_up, down, experts, weights, silu_and_mul=doubled)
    torch.testing.assert_close(twice, 2 * plain)


def test_rejects_unaligned_sizes() -> None:
    """_grouped_mm needs 16-byte strides: the stacks' K-major views have rows of H and I."""
    hidden = torch.randn(3, 12, dtype=BF16)  # H = 12: 24-byte rows
    gate_up = torch.randn(4, 2 * SIZE, 12, dtype=BF16)
    down = torch.randn(4, 12, SIZE, dtype=BF16)
    weights, experts = _routing(3, 4, 2, seed=21)
    with pytest.raises(ValueError, match="multiples of 8"):
        moe_experts_grouped(hidden, gate_up, down, experts, weights.to(BF16))
