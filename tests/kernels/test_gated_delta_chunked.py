"""kernels.gated_delta_chunked on the CPU against kernels.gated_delta_reference.

Both compute in float32 from the same inputs; the reference runs prompts in
its own chunked form (64-token chunks, a triangular solve per chunk), ours
inverts all chunks' systems at once and pads the last chunk, so the two
agree to float32 rounding (measured: max |diff| / max |ref| about 2e-7 for
outputs, 1e-7 for states; against the per-token recurrence about 3e-6, the
same as the reference's own chunked form). Lengths straddle the chunk size
(63, 64, 65) and span several chunks and windows.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import gated_delta_chunked
from kernels.gated_delta_chunked import chunked_sequences, gated_delta_rule_chunked
from kernels.gated_delta_reference import gated_delta_rule, gated_delta_rule_naive, gdn_gating

TOL = {"rtol": 1e-5, "atol": 1e-5}
SLOTS = 7
SMALL, REAL = (2, 4, 16, 16), (2, 4, 128, 128)  # (Hk, Hv, Dk, Dv)


def _inputs(tokens: int, shape: tuple[int, int, int, int], seed: int) -> dict[str, torch.Tensor]:
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(tokens, hk, dk, generator=gen),
        "k": torch.randn(tokens, hk, dk, generator=gen),
        "v": torch.randn(tokens, hv, dv, generator=gen),
        "a": torch.randn(tokens, hv, generator=gen),
        "b": torch.randn(tokens, hv, generator=gen),
        # Decays as trained layers have them: A = 1..16, dt_bias around 0.
        "a_log": torch.rand(hv, generator=gen) * math.log(16.0),
        "dt_bias": torch.randn(hv, generator=gen) * 0.5,
    }


def _pool(shape: tuple[int, int, int, int], seed: int) -> torch.Tensor:
    _, hv, dk, dv = shape
    return torch.randn(SLOTS, hv, dk, dv, generator=torch.Generator().manual_seed(seed)) * 0.3


def _batch(work: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    starts = [0]
    for tokens, _, _ in work:
        starts.append(starts[-1] + tokens)
    slots = torch.tensor([s for _, s, _ in work])
    fresh = torch.tensor([f for _, _, f in work])
    return slots, fresh, tuple(starts)


def _reference(x: dict[str, torch.Tensor], states: torch.Tensor, slots: torch.Tensor,
               fresh: torch.Tensor, qsl: tuple[int, ...], naive: bool = False) -> torch.Tensor:
    g, beta = gdn_gating(x["a"], x["b"], x["a_log"], x["dt_bias"])
    rule = gated_delta_rule_naive if naive else gated_delta_rule
    return rule(x["q"], x["k"], x["v"], g, beta, states, slots, fresh, qsl)


def _chunked(x: dict[str, torch.Tensor], states: torch.Tensor, slots: torch.Tensor,
             fresh: torch.Tensor, qsl: tuple[int, ...], **kwargs: object) -> torch.Tensor:
    return gated_delta_rule_chunked(x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"],
                                    x["dt_bias"], states, slots, fresh, qsl, **kwargs)


CASES = ([(SMALL, tokens) for tokens in (1, 63, 64, 65, 200, 1000)]
         + [(REAL, tokens) for tokens in (1, 65, 1000)])


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize(("shape", "tokens"), CASES)
def test_one_sequence_matches_the_reference(shape: tuple[int, int, int, int], tokens: int,
                                            fresh: bool) -> None:
    x = _inputs(tokens, shape, seed=tokens)
    states, expected_states = _pool(shape, 1), _pool(shape, 1)
    slots, fresh_flags, qsl = _batch([(tokens, 3, fresh)])
    got = _chunked(x, states, slots, fresh_flags, qsl)
    expected = _reference(x, expected_states, slots, fresh_flags, qsl)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(states, expected_states, **TOL)


def test_continuing_a_prompt_equals_the_per_token_recurrence() -> None:
    """A prompt in two pieces (the second continues the first's slot state)
    against the recurrence token by token in one pass."""
    x = _inputs(300, REAL, seed=5)
    states, expected_states = _pool(REAL, 2), _pool(REAL, 2)
    slots, fresh, qsl = _batch([(300, 4, True)])
    expected = _reference(x, expected_states, slots, fresh, qsl, naive=True)
    outs = []
    for start, end in ((0, 130), (130, 300)):
        piece = dict(x, **{name: x[name][start:end] for name in ("q", "k", "v", "a", "b")})
        p_slots, p_fresh, p_qsl = _batch([(end - start, 4, start == 0)])
        outs.append(_chunked(piece, states, p_slots, p_fresh, p_qsl))
    torch.testing.assert_close(torch.cat(outs), expected, **TOL)
    torch.testing.assert_close(states, expected_states, **TOL)


def test_windows_carry_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence longer than a window runs window after window (here of 2
    chunks), each starting from the state the last one ended in."""
    monkeypatch.setattr(gated_delta_chunked, "WINDOW_TOKENS", 2 * gated_delta_chunked.CHUNK_SIZE)
    x = _inputs(300, SMALL, seed=6)
    states, expected_states = _pool(SMALL, 3), _pool(SMALL, 3)
    slots, fresh, qsl = _batch([(300, 0, False)])
    got = _chunked(x, states, slots, fresh, qsl)
    expected = _reference(x, expected_states, slots, fresh, qsl)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(states, expected_states, **TOL)


# (tokens, slot, fresh): slots out of order, a sequence with no tokens, a
# decode row, fresh and continuing prompts; slots 2 and 6 are in no batch.
MIXED = [(70, 5, False), (1, 0, False), (0, 4, False), (200, 1, True), (64, 3, False)]


def test_a_batch_of_sequences_matches_the_reference() -> None:
    tokens = sum(t for t, _, _ in MIXED)
    x = _inputs(tokens, SMALL, seed=7)
    states, expected_states = _pool(SMALL, 4), _pool(SMALL, 4)
    before = states.clone()
    slots, fresh, qsl = _batch(MIXED)
    got = _chunked(x, states, slots, fresh, qsl)
    expected = _reference(x, expected_states, slots, fresh, qsl)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(states, expected_states, **TOL)
    assert torch.equal(states[[2, 4, 6]], before[[2, 4, 6]])


def test_only_the_listed_sequences_are_written() -> None:
    """What CudaOps relies on: the recurrent kernel fills the other rows and
    slots, so the chunked call must leave them exactly as they were."""
    tokens = sum(t for t, _, _ in MIXED)
    x = _inputs(tokens, SMALL, seed=8)
    states, expected_states = _pool(SMALL, 5), _pool(SMALL, 5)
    before = states.clone()
    slots, fresh, qsl = _batch(MIXED)
    out = torch.full(x["v"].shape, math.nan)
    assert _chunked(x, states, slots, fresh, qsl, sequences=[3, 0], out=out) is out
    expected = _reference(x, expected_states, slots, fresh, qsl)
    for i in (0, 3):
        rows = slice(qsl[i], qsl[i + 1])
        torch.testing.assert_close(out[rows], expected[rows], **TOL)
    assert out[qsl[1]:qsl[3]].isnan().all() and out[qsl[4]:].isnan().all()
    torch.testing.assert_close(states[[5, 1]], expected_states[[5, 1]], **TOL)
    assert torch.equal(states[[0, 2, 3, 4, 6]], before[[0, 2, 3, 4, 6]])


def test_bf16_inputs_give_bf16_outputs_like_the_reference() -> None:
    """The model's dtype: beta is rounded to bf16 by the gating, as the
    reference (and the CUDA kernel) do; everything else is float32 inside."""
    x = {name: t.to(torch.bfloat16) for name, t in _inputs(130, SMALL, seed=9).items()}
    states, expected_states = _pool(SMALL, 6), _pool(SMALL, 6)
    slots, fresh, qsl = _batch([(130, 2, False)])
    got = _chunked(x, states, slots, fresh, qsl)
    expected = _reference(x, expected_states, slots, fresh, qsl)
    assert got.dtype == torch.bfloat16
    # One bf16 rounding of float32 results that agree to ~1e-6.
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    assert (got != expected).float().mean() < 0.01
    torch.testing.assert_close(states, expected_states, **TOL)


def test_chunked_sequences_picks_the_long_ones_in_eager_steps_only() -> None:
    least = gated_delta_chunked.MIN_CHUNKED_TOKENS
    qsl = (0, 1, 1 + least, 1 + least + (least - 1), 2 + 3 * least)
    assert chunked_sequences(qsl) == [1, 3]
    assert chunked_sequences(()) == []  # CUDA graphs pass no host bounds
    assert chunked_sequences((0, 1, 2, 3)) == []  # a decode step


def test_float32_matmuls_run_without_tf32_and_the_setting_is_restored() -> None:
    """TF32 (set for the whole process by some callers) would put the chunked
    products far outside float32 rounding; the op turns it off for itself only."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        with gated_delta_chunked._ieee_float32_matmuls():
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = before
