"""The sampling reference (kernels.reference) against a direct loop over the sorted order,
its edge cases, and its random stream. CPU only and fast."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import (
    _philox4x32_10,
    sample_tokens_reference,
    sampling_gumbel_noise,
    sampling_probabilities,
    sampling_survivors,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INF = math.inf


def rows_of(n: int, **values: float) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) for n rows, defaults: sampling with no filter."""
    temperature = torch.full((n,), values.get("temperature", 1.0), dtype=torch.float32)
    top_k = torch.full((n,), int(values.get("top_k", 0)), dtype=torch.int32)
    top_p = torch.full((n,), values.get("top_p", 1.0), dtype=torch.float32)
    min_p = torch.full((n,), values.get("min_p", 0.0), dtype=torch.float32)
    return temperature, top_k, top_p, min_p


def loop_survivors(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> tuple[set[int], bool]:
    """engine/sampling/sampler.py's rule, token by token over the sorted order, in float64.

    Returns (survivors, near_boundary): near_boundary when a top-p or min-p
    comparison is within rounding distance, where float32 may decide otherwise."""
    z = (row / temperature).double()
    order = sorted(range(len(z)), key=lambda i: -float(z[i]))
    probs = torch.softmax(z, dim=0)
    top = float(probs[order[0]])
    survivors, near, before = set(), False, 0.0
    for rank, token in enumerate(order):
        p = float(probs[token])
        drop = (top_k > 0 and rank >= top_k) or (top_p < 1 and before >= top_p) or p < min_p * top
        near |= (top_p < 1 and abs(before - top_p) < 1e-5) or abs(p - min_p * top) < 1e-5 * top
        if rank == 0 or (not drop and z[token] > -INF):
            survivors.add(token)
        before += p
    return survivors, near


def test_matches_a_loop_over_the_sorted_order() -> None:
    gen = torch.Generator().manual_seed(7)
    compared = 0
    for trial in range(300):
        vocab = int(torch.randint(2, 60, (1,), generator=gen))
        row = torch.randn(vocab, generator=gen) * float(torch.rand(1, generator=gen) * 4 + 0.1)
        if trial % 3 == 0:
            row[torch.rand(vocab, generator=gen) < 0.3] = -INF
            row[int(torch.randint(vocab, (1,), generator=gen))] = 1.0
        temperature = float(torch.rand(1, generator=gen) * 1.9 + 0.1)
        top_k = int(torch.randint(-1, vocab + 3, (1,), generator=gen))
        top_p = float(torch.rand(1, generator=gen) * 1.1) if trial % 4 else 1.0
        min_p = float(torch.rand(1, generator=gen) ** 2) if trial % 5 else 0.0
        expected, near = loop_survivors(row, temperature, top_k, top_p, min_p)
        if near:
            continue
        params = rows_of(1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        got = sampling_survivors(row.unsqueeze(0), *params)[0]
        assert set(got.nonzero().flatten().tolist()) == expected, (trial, top_k, top_p, min_p)
        compared += 1
    assert compared > 250


def test_edge_cases() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen) * 2
    logits[:, 5] = -INF
    logits[:, 17] = -INF
    best = logits.argmax(dim=-1)
    finite = logits > -INF

    def survivors(**values: float) -> torch.Tensor:
        return sampling_survivors(logits, *rows_of(4, **values))

    top1 = survivors(top_k=1)
    assert (top1.sum(dim=-1) == 1).all() and top1.gather(1, best[:, None]).all()
    assert torch.equal(survivors(top_k=60), finite)  # top_k > V: off
    assert torch.equal(survivors(top_k=50), finite)
    assert torch.equal(survivors(top_p=1.0), finite)
    assert torch.equal(survivors(top_k=0, top_p=1.0, min_p=0.0), finite)
    assert torch.equal(survivors(top_p=1e-6), top1)  # tiny top_p keeps exactly the top token
    assert torch.equal(survivors(top_p=0.0), top1)
    assert torch.equal(survivors(min_p=1.0), top1)
    assert torch.equal(survivors(top_k=5, top_p=0.0, min_p=1.0), top1)
    for values in ({"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.2}, {"temperature": 0.3, "top_k": 10}):
        kept = survivors(**values)
        assert not (kept & ~finite).any()  # -inf never survives
        probs = sampling_probabilities(logits, *rows_of(4, **values))
        torch.testing.assert_close(probs.sum(dim=-1), torch.ones(4))
        assert torch.equal(probs > 0, kept)


def test_ties_survive_as_a_group() -> None:
    # Value thresholds: equal logits at a cut all survive (a sorted order would
    # have cut inside the group); the maximum's ties always survive.
    row = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, 3.0]])
    kept = sampling_survivors(row, *rows_of(1, top_k=3))[0]
    assert kept.tolist() == [True, False, True, True, True, False, True]
    kept = sampling_survivors(row, *rows_of(1, min_p=1.0))[0]
    assert kept.tolist() == [True, False, False, False, False, False, True]
    kept = sampling_survivors(row, *rows_of(1, top_p=1e-3))[0]
    assert kept.tolist() == [True, False, False, False, False, False, True]
    # Mass strictly above the 2.0 group: the two 3.0s, ~0.63 of the total.
    probs = torch.softmax(row[0], dim=0)
    above = float(probs[0] * 2)
    assert sampling_survivors(row, *rows_of(1, top_p=above + 1e-3))[0, 2:5].all()
    assert not sampling_survivors(row, *rows_of(1, top_p=above - 1e-3))[0, 2:5].any()


def test_greedy_rows_keep_the_first_argmax() -> None:
    row = torch.tensor([[1.0, 5.0, -INF, 5.0], [0.0, 0.0, 0.0, 0.0]])
    temperature, top_k, top_p, min_p = rows_of(2, temperature=0.0)
    kept = sampling_survivors(row, temperature, top_k, top_p, min_p)
    assert kept.tolist() == [[False, True, False, False], [True, False, False, False]]
    seeds = torch.tensor([1, 2])
    tokens = sample_tokens_reference(row, temperature, top_k, top_p, min_p, seeds, seeds)
    assert tokens.tolist() == [1, 0]


def test_philox_known_answers() -> None:
    # Random123's published known-answer vectors for philox4x32_10.
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        words = _philox4x32_10(
            tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key)
        )
        assert tuple(int(w) for w in words) == expected


def test_gumbel_noise_is_standard_gumbel_and_depends_on_seed_and_offset() -> None:
    seeds = torch.tensor([0, 1, 0, -5, 2**62])
    offsets = torch.tensor([0, 0, 1, 7, 2**40])
    noise = sampling_gumbel_noise(seeds, offsets, 40000)
    assert torch.isfinite(noise).all()
    # Mean: the Euler-Mascheroni constant; variance pi^2 / 6 (200000 draws: +-0.003, +-0.01).
    assert abs(float(noise.double().mean()) - 0.5772157) < 0.01
    assert abs(float(noise.double().var()) - math.pi**2 / 6) < 0.03
    for a in range(5):
        for b in range(a):
            assert not torch.equal(noise[a], noise[b])
    # A row's noise depends only on its own (seed, offset).
    alone = sampling_gumbel_noise(seeds[3:4], offsets[3:4], 40000)
    torch.testing.assert_close(alone[0], noise[3], rtol=0, atol=0)


def test_reference_draws_follow_the_probabilities() -> None:
    gen = torch.Generator().manual_seed(11)
    vocab, draws = 64, 20000
    row = torch.randn(1, vocab, generator=gen) * 1.5
    row[0, 3] = -INF
    params = rows_of(1, temperature=0.8, top_k=40, top_p=0.95, min_p=0.01)
    expected = sampling_probabilities(row, *params)[0]
    logits = row.expand(draws, vocab).contiguous()
    many = [p.expand(draws).contiguous() for p in params]
    tokens = sample_tokens_reference(logits, *many, torch.arange(draws), torch.zeros(draws, dtype=torch.int64))
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    assert float((freq - expected).abs().sum() / 2) < 0.03
    assert not (freq[expected == 0] > 0).any()
