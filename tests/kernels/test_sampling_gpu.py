"""kernels.sampling.sample_tokens on the GPU against the torch reference
(kernels.reference: sampling_survivors, sampling_probabilities, sample_tokens_reference)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import (
    sample_tokens_reference,
    sampling_gumbel_noise,
    sampling_probabilities,
    sampling_survivors,
)
from kernels.sampling import sample_tokens

pytestmark = pytest.mark.gpu

QWEN3_VOCAB = 151936
INF = math.inf


def params(n: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) on the GPU; each a scalar or a list of n."""

    def column(value, dtype):
        if isinstance(value, list | tuple):
            assert len(value) == n
            return torch.tensor(value, dtype=dtype, device="cuda")
        return torch.full((n,), value, dtype=dtype, device="cuda")

    return (
        column(temperature, torch.float32),
        column(top_k, torch.int32),
        column(top_p, torch.float32),
        column(min_p, torch.float32),
    )


def draw(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> torch.Tensor:
    """sample_tokens into an out poisoned with -1; checks every row was written."""
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device="cuda")
    result = sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets, out=out)
    assert result is out
    assert (out >= 0).all() and (out < logits.shape[1]).all()
    return out


def assert_same_draws(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> None:
    """The kernel's tokens are the reference's (up to near-ties of the noisy scores, where
    the last bits of log differ between libraries) and always survivors."""
    got = draw(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    expected = sample_tokens_reference(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    keep = sampling_survivors(logits, temperature, top_k, top_p, min_p)
    assert keep.gather(1, got[:, None]).all(), "a drawn token is not a survivor"
    greedy = temperature <= 0
    assert torch.equal(got[greedy], logits[greedy].argmax(dim=-1))
    mismatched = (got != expected).nonzero().flatten()
    if mismatched.numel():
        rows = mismatched
        scaled = logits[rows] / temperature[rows, None]
        scores = scaled + sampling_gumbel_noise(seeds[rows], offsets[rows], logits.shape[1])
        ours = scores.gather(1, got[rows, None])
        theirs = scores.gather(1, expected[rows, None])
        gap = (ours - theirs).abs() / theirs.abs().clamp(min=1.0)
        assert (gap < 1e-5).all(), f"rows {rows.tolist()} differ by {gap.flatten().tolist()}"
    assert mismatched.numel() <= max(1, logits.shape[0] // 100)


def random_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.rand(n, 1, device="cuda", generator=gen) * 6 + 0.5
    return torch.randn(n, vocab, device="cuda", generator=gen) * scale


@pytest.mark.parametrize("vocab", [QWEN3_VOCAB, 1000, 37])
def test_greedy_rows_are_argmax(vocab: int) -> None:
    n = 64
    logits = random_logits(n, vocab, seed=vocab)
    logits[::3, ::2] = -INF  # grammar-masked rows
    logits[1, :] = -INF
    logits[1, vocab - 1] = 0.5  # a single allowed token, last
    for row in range(2, n, 4):  # ties at the maximum: the lowest index wins
        top = logits[row].max() + 1
        logits[row, vocab // 2] = top
        logits[row, vocab // 3] = top
        logits[row, vocab - 1] = top
    temperature = torch.zeros(n, device="cuda")
    temperature[::5] = -1.0  # any temperature <= 0 is greedy
    _, top_k, top_p, min_p = params(n, top_k=5, top_p=0.5, min_p=0.1)
    seeds = torch.arange(n, device="cuda")
    got = draw(logits, temperature, top_k, top_p, min_p, seeds, seeds)
    assert torch.equal(got, logits.argmax(dim=-1))


def mixed_batch(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Rows of every kind: greedy, no filter, each filter alone and together, masks,
    bf16-rounded logits (many exact ties), low and high temperatures."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = random_logits(n, vocab, seed)
    logits[1::4] = logits[1::4].bfloat16().float()
    masked = torch.rand(n, vocab, device="cuda", generator=gen) < 0.6
    masked[::2] = False
    logits[masked] = -INF
    logits[torch.arange(n, device="cuda"), torch.randint(vocab, (n,), device="cuda", generator=gen)] = 1.0
    choices = {
        "temperature": [0.0, 0.3, 0.7, 1.0, 1.5, 0.05, 1.0, 0.9],
        "top_k": [0, 1, 5, 50, 0, 200, vocab + 5, 20, 0],
        "top_p": [1.0, 0.9, 0.5, 1.0, 0.95, 0.2, 0.99, 1.0, 0.0],
        "min_p": [0.0, 0.0, 0.05, 0.0, 0.1, 0.3, 1.0, 0.0, 0.0, 0.02, 0.0],
    }
    columns = {name: [values[i % len(values)] for i in range(n)] for name, values in choices.items()}
    seeds = torch.randint(-(2**62), 2**62, (n,), device="cuda", generator=gen)
    offsets = torch.randint(0, 2**40, (n,), device="cuda", generator=gen)
    return (logits, *params(n, **columns), seeds, offsets)


@pytest.mark.parametrize("vocab", [QWEN3_VOCAB, 4096, 37])
def test_draws_match_the_reference(vocab: int) -> None:
    assert_same_draws(*mixed_batch(96, vocab, seed=vocab + 1))


@pytest.mark.parametrize("vocab", [QWEN3_VOCAB, 64])
def test_drawn_tokens_are_survivors_over_many_seeds(vocab: int) -> None:
    distinct, repeats = 8, 64
    base = mixed_batch(distinct, vocab, seed=5)
    logits, temperature, top_k, top_p, min_p = (t.repeat_interleave(repeats, 0) for t in base[:5])
    seeds = torch.arange(distinct * repeats, device="cuda") * 104729
    offsets = torch.arange(distinct * repeats, device="cuda") % 17
    got = draw(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    keep = sampling_survivors(logits, temperature, top_k, top_p, min_p)
    assert keep.gather(1, got[:, None]).all()


def test_small_survivor_sets_are_all_reached() -> None:
    # Survivors not too many (the test above) and not too few: with 5 near-equal
    # survivors, 2000 draws reach each of them.
    vocab, n = QWEN3_VOCAB, 2000
    row = torch.randn(1, vocab, device="cuda") - 20
    top = torch.tensor([3, 1000, 77777, 151935, 42, 9], device="cuda")
    row[0, top] = torch.tensor([5.0, 5.01, 5.02, 5.03, 5.04, 4.0], device="cuda")
    for filters in ({"top_k": 5}, {"top_p": 0.85}, {"min_p": 0.9}):
        logits = row.expand(n, vocab).contiguous()
        seeds = torch.arange(n, device="cuda")
        got = draw(logits, *params(n, **filters), seeds, seeds)
        assert set(got.unique().tolist()) == set(top[:5].tolist()), filters


def test_wide_buckets_and_exact_ties_fall_back_correctly() -> None:
    # Rows whose cut lands in a bucket of more than 16384 tokens: the radix fallback,
    # exact ties across the cut, values on both sides of zero (with -0.0).
    vocab, n = 40000, 12
    gen = torch.Generator(device="cuda").manual_seed(9)
    logits = torch.full((n, vocab), -30.0, device="cuda")
    logits[0:4, :30000] = torch.rand(4, 30000, device="cuda", generator=gen) * 1e-3
    logits[4:8, :20000] = 0.5
    logits[4:8, 20000:35000] = 0.5 + torch.rand(4, 15000, device="cuda", generator=gen) * 1e-4
    logits[8:12, :30000] = (torch.rand(4, 30000, device="cuda", generator=gen) - 0.5) * 1e-3
    logits[8:12, 100:200] = 0.0
    logits[8:12, 200:300] = -0.0
    logits[:, 39990:] = 2.0
    logits[3] = 0.0  # one tie group
    temperature, top_k, top_p, min_p = params(
        n,
        top_k=[5000, 0, 15010, 10, 15110, 0, 20000, 0, 15010, 0, 15060, 0],
        top_p=[1.0, 0.5, 1.0, 0.5, 1.0, 0.45, 1.0, 0.7, 1.0, 0.3, 1.0, 0.5],
    )
    seeds = torch.arange(n, device="cuda") + 1000
    for offset in range(3):
        assert_same_draws(logits, temperature, top_k, top_p, min_p, seeds, seeds * 0 + offset)


@pytest.mark.parametrize("stream", ["seeds", "offsets"])
def test_frequencies_match_the_probabilities(stream: str) -> None:
    vocab, n = 64, 20000
    gen = torch.Generator(device="cuda").manual_seed(21)
    row = torch.randn(1, vocab, device="cuda", generator=gen) * 1.5
    row[0, 7] = -INF
    index = torch.arange(n, device="cuda")
    seeds, offsets = (index, index * 0) if stream == "seeds" else (index * 0 + 12345, index)
    logits = row.expand(n, vocab).contiguous()
    for filters in (
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.01},
        {"temperature": 0.7},  # no filter: all 63 finite tokens
    ):
        expected = sampling_probabilities(row, *params(1, **filters))[0]
        got = draw(logits, *params(n, **filters), seeds, offsets)
        freq = torch.bincount(got, minlength=vocab).double() / n
        tv = float((freq - expected.double()).abs().sum() / 2)
        assert tv < 0.03, (filters, tv)


def test_a_row_draws_the_same_alone_and_inside_a_batch() -> None:
    vocab = QWEN3_VOCAB
    batch = mixed_batch(100, vocab, seed=77)
    logits, temperature, top_k, top_p, min_p, seeds, offsets = (t.clone() for t in batch)
    logits[37] = torch.randn(vocab, device="cuda") * 3
    temperature[37], top_k[37], top_p[37], min_p[37] = 0.8, 50, 0.9, 0.05
    seeds[37], offsets[37] = 2024, 11
    in_batch = draw(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    alone = draw(*(t[37:38].contiguous() for t in (logits, temperature, top_k, top_p, min_p, seeds, offsets)))
    assert int(in_batch[37]) == int(alone[0])
    again = draw(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    assert torch.equal(again, in_batch)
    # Other seeds and offsets of the same row give other draws.
    n = 64
    many = draw(
        logits[37:38].expand(n, vocab).contiguous(),
        *params(n, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
        torch.full((n,), 2024, device="cuda"),
        torch.arange(n, device="cuda"),
    )
    assert many.unique().numel() > 1


def test_offsets_give_different_draws() -> None:
    n, vocab = 50, 1000
    logits = torch.zeros(n, vocab, device="cuda")  # uniform: 1000 equally likely tokens
    got = draw(logits, *params(n, top_k=0), torch.full((n,), 7, device="cuda"),
               torch.arange(n, device="cuda"))
    assert got.unique().numel() > 40


def test_captured_in_a_cuda_graph() -> None:
    n, vocab = 16, QWEN3_VOCAB
    batch = mixed_batch(n, vocab, seed=3)
    static = [t.clone() for t in batch]
    out = torch.full((n,), -1, dtype=torch.int64, device="cuda")
    sample_tokens(*static, out=out)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_tokens(*static, out=out)
    fresh = mixed_batch(n, vocab, seed=4)
    for target, source in zip(static, fresh, strict=True):
        target.copy_(source)
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, draw(*fresh))


def test_bad_inputs_raise() -> None:
    n, vocab = 4, 100
    good = list(mixed_batch(n, vocab, seed=1))
    names = ["logits", "temperature", "top_k", "top_p", "min_p", "seeds", "offsets"]

    def call_with(**changes) -> None:
        args = dict(zip(names, good, strict=True))
        out = changes.pop("out", None)
        args.update(changes)
        sample_tokens(*args.values(), out=out)

    bad = {
        "logits": [good[0].bfloat16(), good[0][:, ::2], good[0].cpu(), good[0][0], good[0][:, :0]],
        "temperature": [good[1].double(), good[1][:2], good[1].cpu()],
        "top_k": [good[2].long(), good[2][None]],
        "top_p": [good[3].half()],
        "min_p": [good[4][:3]],
        "seeds": [good[5].int(), torch.arange(2 * n, device="cuda")[::2]],
        "offsets": [good[6].float()],
        "out": [
            torch.empty(n, dtype=torch.int32, device="cuda"),
            torch.empty(n + 1, dtype=torch.int64, device="cuda"),
            torch.empty(2 * n, dtype=torch.int64, device="cuda")[::2],
        ],
    }
    for name, values in bad.items():
        for value in values:
            with pytest.raises(ValueError):
                call_with(**{name: value})
    # No rows: nothing to do, nothing launched.
    empty = sample_tokens(good[0][:0], *(t[:0] for t in good[1:]))
    assert empty.shape == (0,)
