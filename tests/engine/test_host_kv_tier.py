"""The prefix cache's host tier in the whole engine (CPU): pages the device
evicts are kept in host memory, copied back when a prompt reuses them, and
give exactly the tokens computed from scratch.

The device pool is made far smaller than the prompts' working set, so the
device prefix cache evicts; the engine runs in-process as in
test_engine_exactness.py. tests/engine/test_host_kv_tier_gpu.py does the same
on CUDA (side-stream copies).
"""

from __future__ import annotations

from pathlib import Path

import torch

import protocol as p
from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.host_tier import HostTier
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs

PAGE = 8
# 16 device pages: one prompt and its output fit, three do not.
SMALL_POOL: dict[str, object] = {"page_size": PAGE, "max_batched_tokens": 32,
                                 "max_concurrency": 2, "kv_capacity_tokens": 128,
                                 "output_window": 8}


def make_engine(model: Path, host_kv_mib: int = 1, **overrides: object
                ) -> tuple[EngineCore, list[p.EngineEvent]]:
    return in_process.make_engine(model, **{**SMALL_POOL, "host_kv_mib": host_kv_mib,
                                            **overrides})


def prompt(seed: int, length: int = 50) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 150000, (length,), generator=generator).tolist()


def greedy(max_tokens: int = 8) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(core: EngineCore, events: list[p.EngineEvent], request_id: str, tokens: list[int],
        params: p.SamplingParams | None = None) -> tuple[list[int], int]:
    """(generated tokens, prompt tokens served from the cache, either tier)."""
    outputs = step_outputs(run_to_completion(core, events,
                                             {request_id: (tokens, params or greedy())}))
    assert outputs and outputs[-1].finish_reason is not None, events
    return [t for o in outputs for t in o.token_ids], outputs[-1].num_cached_tokens


def host(core: EngineCore) -> HostTier:
    tier = core.scheduler.kv.host
    assert tier is not None
    return tier


def page_hashes(core: EngineCore, tokens: list[int]) -> list[bytes]:
    """The chain of hashes of tokens' full pages before the last token."""
    kv, parent, hashes = core.scheduler.kv, ROOT_HASH, []
    for index in range((len(tokens) - 1) // PAGE):
        parent = hash_page(parent, tokens[index * PAGE : (index + 1) * PAGE], kv.fingerprint)
        hashes.append(parent)
    return hashes


def on_device(core: EngineCore, page_hash: bytes) -> bool:
    return page_hash in core.scheduler.kv.pool._by_hash


def evict(core: EngineCore, events: list[p.EngineEvent], conversation: list[int]) -> None:
    """Run other prompts until none of conversation's pages is on the device."""
    for seed in range(100, 104):
        run(core, events, f"other-{seed}", prompt(seed))
    assert not any(on_device(core, h) for h in page_hashes(core, conversation))


def test_a_prefix_restored_from_the_host_gives_the_tokens_computed_from_scratch(
        tiny_qwen3_dir: Path) -> None:
    conversation = prompt(1)
    plain, plain_events = make_engine(tiny_qwen3_dir, host_kv_mib=0)
    expected, _ = run(plain, plain_events, "scratch", conversation)

    core, events = make_engine(tiny_qwen3_dir)
    tier = host(core)
    first, cached = run(core, events, "first", conversation)
    assert first == expected and cached == 0
    hashes = page_hashes(core, conversation)
    pool = core.scheduler.kv.pool
    pages = [pool._by_hash[h] for h in hashes]
    kv_before = [(k[pages].clone(), v[pages].clone()) for k, v in core.runner.kv_caches]
    evict(core, events, conversation)
    assert set(hashes) <= set(tier.cached_hashes())
    hits = tier.counters.hit_pages

    again, cached = run(core, events, "again", conversation)
    assert again == expected
    assert cached == len(hashes) * PAGE == 48  # 6 full pages; the last token is computed
    assert tier.counters.hit_pages - hits == len(hashes)
    # The restored pages hold exactly the K/V computed the first time.
    restored = [pool._by_hash[h] for h in hashes]
    for (k, v), (k_before, v_before) in zip(core.runner.kv_caches, kv_before, strict=True):
        assert torch.equal(k[restored], k_before) and torch.equal(v[restored], v_before)
    stats = core._stats
    assert stats.host_kv_hit_pages_total == tier.counters.hit_pages
    assert stats.host_kv_hit_tokens_total == tier.counters.hit_pages * PAGE
    assert stats.host_kv_bytes_to_device_total == tier.counters.hit_pages * tier.page_bytes
    assert stats.cached_tokens_total >= 48


def test_a_restore_continues_past_the_device_hits_and_chains_on(tiny_qwen3_dir: Path) -> None:
    """A longer prompt reuses the evicted pages from the host and the device's
    for a prefix another request brought back meanwhile."""
    conversation = prompt(2)
    core, events = make_engine(tiny_qwen3_dir)
    plain, plain_events = make_engine(tiny_qwen3_dir, host_kv_mib=0)
    run(core, events, "first", conversation)
    evict(core, events, conversation)
    # Brings back the first three pages (the last token is computed).
    run(core, events, "short", conversation[:3 * PAGE + 1])
    longer = conversation + prompt(3, 20)
    got, cached = run(core, events, "longer", longer)
    assert cached == 6 * PAGE  # 3 pages from the device, 3 from the host
    assert got == run(plain, plain_events, "scratch", longer)[0]


def test_a_page_is_stored_once(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    tier = host(core)
    shared = prompt(4, 32)
    a, b = shared + prompt(5, 18), shared + prompt(6, 18)
    run(core, events, "a", a)
    run(core, events, "b", b)
    evict(core, events, a)
    run(core, events, "a-again", a)  # restored: the host keeps its copy
    evict(core, events, a)  # evicted from the device again
    stored = tier.cached_hashes()
    assert len(stored) == len(set(stored)) == tier.counters.stored_pages
    assert tier.counters.evicted_pages == 0
    shared_hashes = page_hashes(core, [*shared, 0])
    assert all(stored.count(h) == 1 for h in shared_hashes)


def test_scoring_requests_never_read_the_host_tier(tiny_qwen3_dir: Path) -> None:
    conversation = prompt(7)
    core, events = make_engine(tiny_qwen3_dir)
    tier = host(core)
    run(core, events, "first", conversation)
    evict(core, events, conversation)
    hits = tier.counters.hit_pages
    scored = p.SamplingParams(max_tokens=0, prompt_logprobs=0)
    _, cached = run(core, events, "scored", conversation, scored)
    assert cached == 0 and tier.counters.hit_pages == hits
    mean = p.SamplingParams(max_tokens=0, pooling="mean")
    _, cached = run(core, events, "mean", conversation, mean)
    assert cached == 0 and tier.counters.hit_pages == hits
    # A generation does read it (once the scored prompt's pages, which the
    # device cache took, are evicted again).
    evict(core, events, conversation)
    _, cached = run(core, events, "generated", conversation)
    assert cached == 48 and tier.counters.hit_pages > hits


def test_the_host_tier_survives_sleep_and_wake(tiny_qwen3_dir: Path) -> None:
    conversation = prompt(8)
    core, events = make_engine(tiny_qwen3_dir)
    tier = host(core)
    expected, _ = run(core, events, "first", conversation)
    evict(core, events, conversation)
    held = tier.cached_hashes()
    core.handle(p.Sleep(weights="host"))
    core.handle(p.Wake())
    assert not core.asleep and tier.cached_hashes() == held
    got, cached = run(core, events, "after-wake", conversation)
    assert got == expected and cached == 48
    assert tier.counters.hit_pages >= 6


def test_off_by_default(tiny_qwen3_dir: Path) -> None:
    core, _ = in_process.make_engine(tiny_qwen3_dir, **SMALL_POOL)
    assert core.scheduler.kv.host is None and core.runner.host_kv is None
    assert core.scheduler.kv.pool.on_evict is None


def conversation_turns(num_conversations: int, num_turns: int, core: EngineCore,
                       events: list[p.EngineEvent]) -> tuple[dict[str, list[int]], int]:
    """Several conversations growing turn by turn, each turn's prompt the one
    before, its answer and a new message, all of a turn's requests together.
    Returns every request's tokens and how many prompt tokens were cached."""
    histories = {f"c{n}": prompt(200 + n, 30) for n in range(num_conversations)}
    answers: dict[str, list[int]] = {}
    cached = 0
    for turn in range(num_turns):
        requests = {f"{name}-t{turn}": (history, greedy())
                    for name, history in histories.items()}
        outputs = step_outputs(run_to_completion(core, events, requests))
        finished = {o.request_id: o for o in outputs if o.finish_reason is not None}
        assert set(finished) == set(requests), "a request was lost"
        for request_id in requests:
            answers[request_id] = [t for o in outputs if o.request_id == request_id
                                   for t in o.token_ids]
            assert len(answers[request_id]) == 8
            cached += finished[request_id].num_cached_tokens
        for name in histories:
            histories[name] = (histories[name] + answers[f"{name}-t{turn}"]
                               + prompt(300 + turn * 10 + int(name[1:]), 22))
    return answers, cached


def test_a_multi_turn_workload_far_larger_than_the_pool_keeps_serving(
        tiny_qwen3_dir: Path) -> None:
    """Ten conversations growing to 218 tokens (2,180 in all) against a device
    pool of 256 tokens and a host tier of 256 pages (2,048 tokens): the host
    tier fills and evicts, every request finishes with the tokens computed
    without it, and the counters add up."""
    core, events = make_engine(tiny_qwen3_dir, kv_capacity_tokens=256, max_concurrency=4)
    plain, plain_events = make_engine(tiny_qwen3_dir, host_kv_mib=0, kv_capacity_tokens=256,
                                      max_concurrency=4)
    tier = host(core)
    assert tier.num_slots == 256  # 1 MiB of 4 KiB pages
    got, cached = conversation_turns(10, 7, core, events)
    expected, plain_cached = conversation_turns(10, 7, plain, plain_events)
    assert got == expected
    counters = tier.counters
    assert counters.evicted_pages > 0 and counters.hit_pages > 0 and counters.misses > 0
    assert counters.stored_pages - counters.evicted_pages == tier.num_cached == tier.num_slots
    assert counters.hit_tokens == counters.hit_pages * PAGE
    assert counters.bytes_to_host == counters.stored_pages * tier.page_bytes
    assert counters.bytes_to_device == counters.hit_pages * tier.page_bytes
    # Every cached token came from one of the tiers; the host tier served
    # most, far more than the device alone could.
    assert cached == core.scheduler.num_cached_tokens_total
    assert plain_cached < cached and counters.hit_tokens <= cached
    core.scheduler.check_invariants()
    stats = core._stats
    assert (stats.host_kv_stored_pages_total, stats.host_kv_evicted_pages_total,
            stats.host_kv_misses_total, stats.host_kv_pages_cached) == (
        counters.stored_pages, counters.evicted_pages, counters.misses, tier.num_cached)
