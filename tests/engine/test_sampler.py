from __future__ import annotations

import torch

from engine.sampling.sampler import Sampler
from engine.scheduling.sequence import Sequence
from protocol import SamplingParams


def seq(request_id: str = "r", tokens: tuple[int, ...] = (1,), outputs: tuple[int, ...] = (),
        **params: object) -> Sequence:
    s = Sequence(request_id, list(tokens), SamplingParams(max_tokens=10, **params))  # type: ignore[arg-type]
    s.token_ids.extend(outputs)
    return s


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def draws(params: dict, count: int = 2000, seed: int = 0) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=seed)
    rows = [seq(f"r{i}", **params) for i in range(count)]
    return torch.tensor(sampler.sample(LOGITS.repeat(count, 1), rows))


def test_greedy_is_argmax() -> None:
    assert draws({"temperature": 0.0}, count=5).tolist() == [0] * 5
    assert draws({"top_k": 1}, count=5).tolist() == [0] * 5


def test_a_vanishing_temperature_is_greedy() -> None:
    """logits / 1e-40 overflows float32: the draw raised on inf before; any
    temperature below 1e-5 now samples the argmax, as temperature 0 does."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]]).repeat(4, 1)
    for temperature in (1e-40, 1e-20, 9e-6):
        rows = [seq(f"r{i}", temperature=temperature) for i in range(4)]
        assert Sampler(torch.device("cpu"), seed=0).sample(logits.clone(), rows) == [1] * 4
    assert not SamplingParams(max_tokens=1, temperature=1e-4).greedy


def test_temperature_sampling_follows_the_softmax() -> None:
    got = torch.bincount(draws({"temperature": 1.0}), minlength=5).float() / 2000
    expected = LOGITS[0].softmax(-1)
    assert torch.allclose(got, expected, atol=0.03), (got, expected)


def test_top_k_top_p_and_min_p_cut_the_tail() -> None:
    assert set(draws({"top_k": 2}).tolist()) == {0, 1}
    # p = [0.53, 0.20, 0.12, 0.07, 0.03]: top_p 0.7 keeps the first two.
    assert set(draws({"top_p": 0.7}).tolist()) == {0, 1}
    # min_p 0.3 keeps tokens with p >= 0.3 * 0.53.
    assert set(draws({"min_p": 0.3}).tolist()) == {0, 1}
    assert set(draws({"top_p": 0.01}).tolist()) == {0}


def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))

    def tokens(batch_extra: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), seed=batch_extra)
        mine = seq("mine", temperature=1.0, seed=42)
        out = []
        for _ in range(10):
            others = [seq(f"o{i}", temperature=1.0) for i in range(batch_extra)]
            rows = [*others, mine]
            out.append(sampler.sample(logits.repeat(len(rows), 1), rows)[-1])
        return out

    assert tokens(0) == tokens(3) == tokens(7)


def test_penalties_push_generated_tokens_down() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[1.0, 1.0, 0.9]])
    # Token 0 was generated twice: a frequency penalty of 0.1 per use moves the
    # choice to token 1.
    assert sampler.sample(logits.clone(), [seq(outputs=(0, 0), temperature=0.0, frequency_penalty=0.1)]) == [1]
    assert sampler.sample(logits.clone(), [seq(outputs=(0, 1), temperature=0.0, presence_penalty=0.5)]) == [2]
    # Repetition penalty counts prompt tokens too (token 1 is the prompt here).
    assert sampler.sample(logits.clone(), [seq(tokens=(0, 1), temperature=0.0, repetition_penalty=1.5)]) == [2]


def test_a_penalty_window_looks_only_at_the_last_tokens() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[1.0, 0.95, 0.9]])
    # Token 0 is outside a window of one token, so only token 1 is penalized.
    recent = seq(tokens=(0, 1), temperature=0.0, repetition_penalty=2.0, penalty_last_n=1)
    assert sampler.sample(logits.clone(), [recent]) == [0]
    everything = seq(tokens=(0, 1), temperature=0.0, repetition_penalty=2.0)
    assert sampler.sample(logits.clone(), [everything]) == [2]
    # With a window, presence counts the context's last tokens (llama.cpp), not just output.
    windowed = seq(tokens=(0,), temperature=0.0, presence_penalty=0.5, penalty_last_n=4)
    assert sampler.sample(logits.clone(), [windowed]) == [1]
    assert sampler.sample(logits.clone(), [seq(tokens=(0,), temperature=0.0, presence_penalty=0.5)]) == [0]


def test_logit_bias_moves_and_bans_tokens() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    assert sampler.sample(logits.clone(), [seq(temperature=0.0, logit_bias={2: 5.0})]) == [2]
    assert sampler.sample(logits.clone(), [seq(temperature=0.0, logit_bias={0: float("-inf")})]) == [1]
    # A sampled row never draws a banned token.
    rows = [seq(f"r{i}", temperature=1.0, logit_bias={0: float("-inf"), 1: float("-inf")})
            for i in range(50)]
    assert set(sampler.sample(logits.repeat(50, 1), rows)) == {2}
