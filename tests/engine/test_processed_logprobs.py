"""Processed log probabilities (SamplingParams.logprobs_mode "processed",
llama.cpp's post_sampling_probs): the distribution each token was drawn from,
checked on CPU against a torch reference built from transformers' float32
logits (bias, temperature, top-k, top-p, min-p, renormalised), while raw rows
in the same batch stay the model's own log_softmax."""

from __future__ import annotations

import math

import pytest
import torch

import protocol as p
from engine.sampling.sampler import Sampler
from engine.scheduling.sequence import Sequence
from kernels.reference import sampling_probabilities
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion
from tests.engine.test_engine_exactness import prompts
from tests.engine.test_logprobs import collect, reference_logprobs

NEW_TOKENS = 8
BIASED = 30  # a token id pushed up by the sampled rows' logit_bias


def processed_reference(logits: torch.Tensor, params: p.SamplingParams) -> torch.Tensor:
    """[V] log of the distribution the torch sampler draws from, from raw logits [V]."""
    biased = logits.clone()
    for token, bias in params.logit_bias.items():
        biased[token] += bias
    if params.greedy:
        return torch.full_like(biased, -math.inf).index_fill_(0, biased.argmax(), 0.0)
    scaled = biased / params.temperature
    ordered, order = scaled.sort(descending=True)
    probs = ordered.softmax(dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k:] = False
    keep &= (probs.cumsum(dim=-1) - probs) < params.top_p
    keep &= probs >= params.min_p * probs[0]
    keep[0] = True
    kept = ordered.masked_fill(~keep, -math.inf).log_softmax(dim=-1)
    return torch.empty_like(kept).scatter_(0, order, kept)


def sampled(mode: str, **overrides: object) -> p.SamplingParams:
    settings: dict[str, object] = {
        "max_tokens": NEW_TOKENS, "ignore_eos": True, "logprobs": 5, "logprobs_mode": mode,
        "temperature": 0.7, "top_k": 12, "top_p": 0.9, "min_p": 0.02, "seed": 5,
        "logit_bias": {BIASED: 2.5}}
    settings.update(overrides)
    return p.SamplingParams(**settings)  # type: ignore[arg-type]


def test_processed_logprobs_equal_the_sampling_distribution(tiny_qwen3_dir, qwen3_reference) -> None:  # type: ignore[no-untyped-def]
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    cases = prompts(tiny_qwen3_dir)
    requests = {
        "processed": (cases["pages"], sampled("processed")),
        "narrow": (cases["short"], sampled("processed", temperature=1.3, top_k=0, top_p=0.6,
                                           min_p=0.0, seed=9)),
        "greedy": (cases["long"], sampled("processed", temperature=0.0, logprobs=3)),
        "raw": (cases["pages"], sampled("raw")),
        "none": (cases["short"], sampled("processed", logprobs=-1)),
    }
    got = collect(run_to_completion(core, events, requests))
    assert got["none"][1] == []
    for name in ("processed", "narrow", "greedy", "raw"):
        tokens, logprobs = got[name]
        prompt, settings = requests[name]
        assert len(tokens) == len(logprobs) == NEW_TOKENS, name
        raw = reference_logprobs(qwen3_reference, prompt, tokens)
        for position, (token, entry) in enumerate(zip(tokens, logprobs, strict=True)):
            row = raw[position] if name == "raw" else processed_reference(raw[position], settings)
            assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-4), (name, position)
            assert math.isfinite(entry.logprob), (name, position)  # drawn from the survivors
            assert len(entry.top_ids) == settings.logprobs
            kept = int(torch.isfinite(row).sum())
            top = row.topk(min(settings.logprobs, kept))
            # The survivors come first, most likely first; cut tokens after, at -inf.
            assert entry.top_logprobs[:kept] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert entry.top_ids[:kept] == top.indices.tolist(), (name, position)
            assert all(v == -math.inf for v in entry.top_logprobs[kept:]), (name, position)
            if name == "greedy":
                assert entry.logprob == 0.0 and entry.top_ids[0] == token
    # The sampled rows really were cut: more than one survivor, at most top_k.
    first = processed_reference(reference_logprobs(qwen3_reference, cases["pages"],
                                                   got["processed"][0])[0], requests["processed"][1])
    assert 1 < int(torch.isfinite(first).sum()) <= 12


def test_processed_mode_does_not_change_the_tokens(tiny_qwen3_dir) -> None:  # type: ignore[no-untyped-def]
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    prompt = prompts(tiny_qwen3_dir)["pages"]
    raw = collect(run_to_completion(core, events, {"a": (prompt, sampled("raw"))}))["a"][0]
    processed = collect(run_to_completion(core, events, {"a": (prompt, sampled("processed"))}))["a"][0]
    assert processed == raw


def _seqs(params: list[p.SamplingParams]) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], settings) for i, settings in enumerate(params)]


def test_kernel_path_reports_the_kernel_survivors() -> None:
    """On the kernel path the distribution is the kernel's rule
    (kernels.reference.sampling_probabilities); checked here on CPU tensors,
    where the rule runs as torch ops. A top_k of 1 is greedy, as the kernel
    is told."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=generator) * 3
    settings = [sampled("processed", temperature=0.8, top_k=7, top_p=0.8, min_p=0.05),
                sampled("processed", temperature=0.0),
                sampled("processed", temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)]
    final = Sampler(torch.device("cpu"), use_kernel=True).final_logprobs(logits, _seqs(settings))
    expected = sampling_probabilities(
        logits, torch.tensor([0.8, 0.0, 0.0]), torch.tensor([7, 12, 1], dtype=torch.int32),
        torch.tensor([0.8, 0.9, 1.0]), torch.tensor([0.05, 0.02, 0.0])).log()
    assert torch.allclose(final.exp(), expected.exp(), atol=1e-6)
    assert torch.equal(torch.isfinite(final), expected > -math.inf)
    for row in (1, 2):
        assert int(final[row].argmax()) == int(logits[row].argmax()) and float(final[row].max()) == 0.0
