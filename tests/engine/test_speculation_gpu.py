"""Speculative decoding on CUDA (bf16, our kernels, CUDA graphs for the plain
steps; verify steps run eagerly): the target tokens reach the host through
their own page-locked buffer, drafts are accepted on a prompt that repeats
itself, no page leaks, and the greedy tokens are those of the same engine
without speculation (tests/engine/test_speculation.py on CUDA).

A divergence here, with the CPU tests green, would be bf16 numerics: a
verify chunk runs the prefill kernels where plain decoding runs the decode
kernel.
Run on the lent GPU: pytest -m gpu this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import protocol as p
from tests.engine import in_process
from tests.engine.in_process import run_to_completion
from tests.engine.test_host_kv_tier_gpu import PAGE, prompt, qwen3_bf16

pytestmark = pytest.mark.gpu
__all__ = ["qwen3_bf16"]  # the module's fixture, shared


def tokens_of(model: Path, requests: dict[str, tuple[list[int], p.SamplingParams]],
              **options: object) -> tuple[dict[str, list[int]], int]:
    """Each request's tokens, and the draft tokens accepted."""
    core, events = in_process.make_engine(model, **{
        "device": "cuda", "dtype": "bfloat16", "page_size": PAGE, "max_concurrency": 4,
        "max_batched_tokens": 256, "kv_capacity_tokens": 4096, **options})
    found: dict[str, list[int]] = {name: [] for name in requests}
    for event in run_to_completion(core, events, requests):
        assert isinstance(event, p.StepOutputs)
        for output in event.outputs:
            found[output.request_id].extend(output.token_ids)
    pool = core.scheduler.kv.pool
    assert pool.num_used == 0 and core.scheduler.kv.outstanding == 0
    return found, core._stats.draft_accepted_tokens_total


def test_ngram_speculation_on_cuda_matches_plain_decoding(qwen3_bf16: Path) -> None:
    # A random model repeats itself sooner or later; a prompt that repeats
    # a block gives the drafter matches from the start.
    block = prompt(3, 40)
    greedy = p.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    requests = {"repeat": (block * 3, greedy), "plain": (prompt(4, 100), greedy),
                "sampled": (prompt(5, 60), p.SamplingParams(max_tokens=24, temperature=0.8,
                                                            seed=3, ignore_eos=True))}
    want, _ = tokens_of(qwen3_bf16, requests)
    got, accepted = tokens_of(qwen3_bf16, requests, spec="ngram", draft_tokens=4)
    assert accepted > 0
    assert got == want
