"""Processed log probabilities on the kernel path (CUDA): the kernel's draws
follow the distribution final_logprobs reports, and the engine sends it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.sampling.sampler import Sampler
from engine.scheduling.sequence import Sequence
from tests.engine import in_process
from tests.engine.in_process import run_to_completion
from tests.engine.test_logprobs import collect

pytestmark = pytest.mark.gpu

DRAWS = 8000


def test_the_kernel_draws_from_the_reported_distribution() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(1, 4096) * 2.5).cuda()
    settings = p.SamplingParams(max_tokens=1, temperature=0.9, top_k=30, top_p=0.9, min_p=0.01,
                                logprobs=5, logprobs_mode="processed")
    # Each request has its own random stream: DRAWS independent draws.
    seqs = [Sequence(f"r{i}", [1, 2, 3], settings) for i in range(DRAWS)]
    sampler = Sampler(torch.device("cuda"), seed=1, use_kernel=True)
    rows = logits.expand(DRAWS, -1).contiguous()
    tokens = sampler.sample_on_device(rows.clone(), seqs)
    final = sampler.final_logprobs(rows[:1], seqs[:1])[0]
    assert torch.isfinite(final[tokens]).all()  # never a token the report calls cut
    survivors = int(torch.isfinite(final).sum())
    assert 2 < survivors <= 30
    counts = torch.bincount(tokens, minlength=logits.shape[1]).float() / DRAWS
    # 8000 draws: a frequency's standard deviation is at most 0.0056.
    assert (counts - final.exp()).abs().max().item() < 0.03
    assert final.exp().sum().item() == pytest.approx(1.0, abs=1e-5)
    greedy = Sequence("g", [1, 2, 3], p.SamplingParams(max_tokens=1, temperature=0.0))
    one_hot = sampler.final_logprobs(logits.clone(), [greedy])[0]
    assert one_hot[int(logits.argmax())] == 0.0 and int(torch.isfinite(one_hot).sum()) == 1


def test_the_engine_sends_processed_logprobs_on_the_gpu(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, device="cuda", dtype="bfloat16",
                                          page_size=16, max_concurrency=4, max_batched_tokens=256,
                                          kv_capacity_tokens=8192)
    prompt = list(range(100, 140))
    base = {"max_tokens": 12, "ignore_eos": True, "logprobs": 8}
    requests = {
        "processed": (prompt, p.SamplingParams(**base, temperature=0.8, top_k=6, seed=4,  # type: ignore[arg-type]
                                               logprobs_mode="processed")),
        "greedy": (prompt, p.SamplingParams(**base, temperature=0.0, logprobs_mode="processed")),  # type: ignore[arg-type]
        "raw": (prompt, p.SamplingParams(**base, temperature=0.8, top_k=6, seed=4)),  # type: ignore[arg-type]
    }
    got = collect(run_to_completion(core, events, requests))
    assert got["processed"][0] == got["raw"][0]  # the mode changes no token
    for token, entry in zip(*got["processed"], strict=True):
        finite = [v for v in entry.top_logprobs if v > -math.inf]
        assert 1 <= len(finite) <= 6 and sum(math.exp(v) for v in finite) == pytest.approx(1.0, abs=1e-4)
        assert token in entry.top_ids[:len(finite)] and math.isfinite(entry.logprob)
    for token, entry in zip(*got["greedy"], strict=True):
        assert entry.logprob == 0.0 and entry.top_ids[0] == token
        assert all(v == -math.inf for v in entry.top_logprobs[1:])
    for _, entry in zip(*got["raw"], strict=True):
        # The raw distribution covers the vocabulary: no cut alternatives.
        assert all(math.isfinite(v) for v in entry.top_logprobs)
