"""Reuse to the token (engine/kv/partial_pages.py) in the whole engine (CPU):
a prompt reuses the matching start of a cached page that is not wholly its
own (a partial last page, or a full page whose later tokens differ), through
a copy into a fresh page, and gets exactly the tokens computed from scratch;
cache_prompt false keeps a request out of the cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.partial_pages import partial_hash
from engine.scheduling.core import EngineCore
from engine.scheduling.scheduler import SchedulerOutput
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs

PAGE = 16
OPTIONS: dict[str, object] = {"page_size": PAGE, "max_batched_tokens": 32, "max_concurrency": 4,
                              "kv_capacity_tokens": 1024}


def make_engine(model: Path, **overrides: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    return in_process.make_engine(model, **{**OPTIONS, **overrides})


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 150000, (length,), generator=generator).tolist()


def greedy(max_tokens: int = 6, **fields: object) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            **fields)  # type: ignore[arg-type]


class Result:
    def __init__(self, outputs: list[p.RequestOutput]) -> None:
        assert outputs and outputs[-1].finish_reason is not None, outputs
        self.tokens = [t for o in outputs for t in o.token_ids]
        self.cached = outputs[-1].num_cached_tokens
        hits = [o.cache_hits for o in outputs if o.cache_hits is not None]
        assert len(hits) <= 1, "the tiers are reported once, in the first output"
        self.hits = hits[0] if hits else None


def run_all(core: EngineCore, events: list[p.EngineEvent],
            requests: dict[str, tuple[list[int], p.SamplingParams]]) -> dict[str, Result]:
    outputs = step_outputs(run_to_completion(core, events, requests))
    return {rid: Result([o for o in outputs if o.request_id == rid]) for rid in requests}


def run(core: EngineCore, events: list[p.EngineEvent], request_id: str, tokens: list[int],
        params: p.SamplingParams | None = None) -> Result:
    return run_all(core, events, {request_id: (tokens, params or greedy())})[request_id]


def scratch(model: Path, tokens: list[int], params: p.SamplingParams | None = None) -> list[int]:
    core, events = make_engine(model)
    return run(core, events, "scratch", tokens, params).tokens


def kv_bytes(core: EngineCore, page: int) -> list[torch.Tensor]:
    return [cache[page].clone() for caches in core.runner.kv_caches for cache in caches]


def test_a_repeated_nine_token_prompt_reuses_eight_tokens(tiny_qwen3_dir: Path) -> None:
    tokens = prompt(1, 9)
    expected = scratch(tiny_qwen3_dir, tokens)
    core, events = make_engine(tiny_qwen3_dir)
    first = run(core, events, "first", tokens)
    assert first.tokens == expected and first.cached == 0
    # The first page is partial (9 + 5 computed tokens): kept for reuse.
    assert len(core.scheduler.kv.partial) == 1
    again = run(core, events, "again", tokens)
    assert again.tokens == expected
    assert again.cached == 8  # all but the last prompt token, always computed
    assert again.hits == p.CacheHits(partial=8)
    stats = core._stats
    assert (stats.partial_kv_hits_total, stats.partial_kv_hit_tokens_total) == (1, 8)
    assert stats.cached_tokens_total == 8


def test_a_full_page_whose_later_tokens_differ_is_reused_to_the_token(
        tiny_qwen3_dir: Path) -> None:
    """A first run long enough to fill its first page registers it whole;
    a 9-token prompt that starts it still reuses its first 8 tokens."""
    tokens = prompt(2, 9)
    core, events = make_engine(tiny_qwen3_dir)
    run(core, events, "long", tokens, greedy(20))  # 29 tokens: the first page is full
    again = run(core, events, "again", tokens)
    assert again.tokens == scratch(tiny_qwen3_dir, tokens)
    assert again.hits == p.CacheHits(partial=8)


def test_a_second_turn_reuses_its_first_turns_partial_page_without_writing_it(
        tiny_qwen3_dir: Path) -> None:
    turn = prompt(3, 20)
    core, events = make_engine(tiny_qwen3_dir)
    first = run(core, events, "turn-1", turn, greedy(5))
    # 24 tokens computed: page 0 full, page 1 holds 8 (4 prompt + 4 output).
    kv = core.scheduler.kv
    parent = hash_page(ROOT_HASH, turn[:PAGE], kv.fingerprint)
    held = (turn + first.tokens)[PAGE:24]
    source = kv.pool.lookup(partial_hash(parent, held, kv.fingerprint), held)
    assert source is not None
    before = kv_bytes(core, source)

    second = turn + first.tokens + prompt(4, 6)
    got = run(core, events, "turn-2", second)
    assert got.tokens == scratch(tiny_qwen3_dir, second)
    assert got.cached == 24 and got.hits == p.CacheHits(device=16, partial=8)
    # Copy on write: turn 2 wrote its own page, never the cached one.
    assert kv.pool.lookup(partial_hash(parent, held, kv.fingerprint), held) == source
    for after, was in zip(kv_bytes(core, source), before, strict=True):
        assert torch.equal(after, was)


def test_a_batch_shares_one_cached_partial_page(tiny_qwen3_dir: Path) -> None:
    base = prompt(5, 10)
    core, events = make_engine(tiny_qwen3_dir)
    run(core, events, "seed", base, greedy(2))  # 11 tokens of page 0 cached
    batch = {f"r{i}": (base[:8] + prompt(10 + i, 4 + i), greedy()) for i in range(3)}
    results = run_all(core, events, batch)
    for name, (tokens, params) in batch.items():
        assert results[name].tokens == scratch(tiny_qwen3_dir, tokens, params), name
        assert results[name].hits == p.CacheHits(partial=8), name
    assert core.scheduler.kv.partial.hits == 3


def test_a_preempted_sequence_is_readmitted_with_its_partial_page(
        tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence preempted mid-decode (its newest token still in flight)
    leaves its partial last page in the cache, and its recompute starts
    from there: no token of that page is computed again, and every token
    stays exact."""
    tokens = prompt(6, 21)
    params = greedy(12)
    core, events = make_engine(tiny_qwen3_dir)
    events.clear()
    core.handle(p.Generate("victim", tokens, params))
    scheduler = core.scheduler
    (seq,) = scheduler.running or scheduler.waiting
    while seq.num_output_tokens < 5:
        core.step()
    assert seq.has_pending_token and seq.num_computed_tokens % PAGE
    computed = seq.num_computed_tokens
    scheduler._preempt(seq, SchedulerOutput())
    prefill_before = core._stats.prefill_tokens_total
    kv = scheduler.kv
    copied: list[int] = []
    queue_copy = kv.partial.copy
    monkeypatch.setattr(kv.partial, "copy", lambda hit, target: (
        copied.append(hit.num_tokens), queue_copy(hit, target)))
    while core.has_work:
        core.step()
        scheduler.check_invariants()
    got = Result([o for o in step_outputs(events) if o.request_id == "victim"])
    assert got.tokens == scratch(tiny_qwen3_dir, tokens, params)
    # The full page and every token the partial one held were reused.
    assert copied == [computed - PAGE]
    assert core._stats.prefill_tokens_total - prefill_before <= 2
    assert got.hits == p.CacheHits()  # reported once, at its first admission
    # ... and counted once: a recompute's hits are not cached prompt tokens.
    assert kv.partial.hits == 0 and core._stats.cached_tokens_total == 0


def test_cache_prompt_false_takes_no_hits_and_leaves_nothing_cached(
        tiny_qwen3_dir: Path) -> None:
    tokens = prompt(7, 40)
    core, events = make_engine(tiny_qwen3_dir)
    off = greedy(cache_prompt=False)
    first = run(core, events, "first", tokens, off)
    kv = core.scheduler.kv
    assert kv.pool.num_cached == 0 and len(kv.partial) == 0
    again = run(core, events, "again", tokens, off)
    assert again.tokens == first.tokens and again.cached == 0
    assert again.hits in (None, p.CacheHits())
    # Cached by a request that caches: still no hit for one that does not.
    run(core, events, "cached", tokens)
    assert kv.pool.num_cached > 0
    assert run(core, events, "off", tokens, off).cached == 0
    assert run(core, events, "on", tokens).cached == 39
    assert core._stats.prefill_tokens_total == 4 * 40 + 1


def test_scored_prompts_take_no_partial_hits(tiny_qwen3_dir: Path) -> None:
    tokens = prompt(8, 9)
    core, events = make_engine(tiny_qwen3_dir)
    run(core, events, "first", tokens)
    scored = run(core, events, "scored", tokens, greedy(prompt_logprobs=0))
    assert scored.cached == 0 and core.scheduler.kv.partial.hits == 0
