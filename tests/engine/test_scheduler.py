"""The scheduler and KV manager under random workloads, with a fake model."""

from __future__ import annotations

import random

import pytest

from engine.kv.block_hash import kv_fingerprint
from engine.kv.block_pool import BlockPool
from engine.kv.kv_manager import KVManager
from engine.scheduling.scheduler import Scheduler, SchedulerOutput
from engine.scheduling.sequence import SeqStatus, Sequence
from protocol import SamplingParams

EOS = 0


def make_scheduler(
    num_pages: int = 64,
    page_size: int = 4,
    lanes: int = 4,
    budget: int = 32,
    max_context: int = 128,
    window: int = 8,
) -> Scheduler:
    kv = KVManager(BlockPool(num_pages, page_size), kv_fingerprint("fake"), window, max_context)
    return Scheduler(kv, max_concurrency=lanes, max_batched_tokens=budget, max_context=max_context)


def seq(request_id: str, prompt: list[int], max_tokens: int = 8, ignore_eos: bool = True) -> Sequence:
    # As the router builds them: the model's end token is one of the stop
    # tokens unless ignore_eos.
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=[] if ignore_eos else [EOS])
    return Sequence(request_id, prompt, params)


def fake_tokens(out: SchedulerOutput, rng: random.Random, eos_rate: float = 0.0) -> list[int]:
    return [EOS if rng.random() < eos_rate else rng.randrange(1, 50)
            for chunk in out.chunks if chunk.samples]


def run_step(sched: Scheduler, rng: random.Random, eos_rate: float = 0.0) -> SchedulerOutput:
    out = sched.schedule()
    assert out.num_tokens <= sched.max_batched_tokens
    sched.update(out, fake_tokens(out, rng, eos_rate))
    sched.check_invariants()
    return out


def test_single_request_prefills_in_chunks_then_decodes() -> None:
    sched = make_scheduler(budget=8)
    request = seq("a", list(range(1, 21)), max_tokens=3)
    sched.add(request)
    rng = random.Random(0)
    sizes = []
    while sched.has_work():
        out = run_step(sched, rng)
        sizes.append([c.num_tokens for c in out.chunks])
    assert sizes == [[8], [8], [4], [1], [1]]
    assert request.status is SeqStatus.FINISHED and request.finish_reason == "length"
    assert request.num_output_tokens == 3
    assert sched.kv.pool.num_free == sched.kv.pool.num_pages


def test_decode_rows_are_never_stalled_by_a_long_prompt() -> None:
    sched = make_scheduler(budget=8, lanes=4, max_context=512, num_pages=256)
    rng = random.Random(1)
    for name in "abc":
        sched.add(seq(name, [1, 2, 3], max_tokens=50))
    run_step(sched, rng)
    sched.add(seq("long", list(range(1, 200)), max_tokens=2))
    for _ in range(10):
        out = run_step(sched, rng)
        decoding = {c.seq.request_id for c in out.chunks if c.num_tokens == 1}
        assert {"a", "b", "c"} <= decoding


def test_admission_is_first_come_first_served() -> None:
    sched = make_scheduler(lanes=1)
    rng = random.Random(2)
    order = []
    for name in ["first", "second", "third"]:
        sched.add(seq(name, [5, 6, 7], max_tokens=2))
    while sched.has_work():
        out = run_step(sched, rng)
        for chunk in out.chunks:
            if chunk.seq.request_id not in order:
                order.append(chunk.seq.request_id)
    assert order == ["first", "second", "third"]


def test_prefix_cache_skips_full_pages_but_always_computes_the_last_token() -> None:
    sched = make_scheduler(page_size=4)
    rng = random.Random(3)
    prompt = list(range(1, 14))  # 13 tokens: 3 full pages
    first = seq("a", prompt, max_tokens=1)
    sched.add(first)
    while sched.has_work():
        run_step(sched, rng)
    assert first.num_cached_tokens == 0
    again = seq("b", prompt, max_tokens=1)
    sched.add(again)
    out = sched.schedule()
    assert again.num_cached_tokens == 12
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(12, 1)]
    sched.update(out, fake_tokens(out, rng))
    # Exactly page-aligned: the last page is not reused whole, but its
    # tokens before the last are, to the token (engine/kv/partial_pages.py).
    aligned = seq("c", list(range(1, 13)), max_tokens=1)
    sched.add(aligned)
    sched.schedule()
    assert aligned.num_cached_tokens == 11


def test_pool_exhaustion_preempts_the_newest_and_everyone_finishes() -> None:
    # 12 pages of 4 tokens; each request wants 4 + 30 tokens -> 9 pages.
    sched = make_scheduler(num_pages=12, page_size=4, lanes=3, window=4, max_context=64)
    rng = random.Random(4)
    requests = [seq(f"r{i}", [i + 1] * 4, max_tokens=30) for i in range(3)]
    for request in requests:
        sched.add(request)
    steps = 0
    while sched.has_work():
        run_step(sched, rng)
        steps += 1
        assert steps < 1000
    assert sched.num_preemptions > 0
    for request in requests:
        assert request.finish_reason == "length"
        assert request.num_output_tokens == 30


def test_abort_frees_pages_in_either_queue() -> None:
    sched = make_scheduler(lanes=1)
    rng = random.Random(5)
    running = seq("run", [1, 2, 3, 4, 5], max_tokens=100)
    waiting = seq("wait", [1, 2, 3], max_tokens=100)
    sched.add(running)
    sched.add(waiting)
    run_step(sched, rng)
    assert running.status is SeqStatus.RUNNING and waiting.status is SeqStatus.WAITING
    aborted = sched.abort(["run", "wait", "unknown"])
    assert [s.request_id for s in aborted] == ["run", "wait"]
    assert all(s.finish_reason == "abort" for s in aborted)
    assert not sched.has_work()
    sched.check_invariants()
    assert sched.kv.pool.num_free == sched.kv.pool.num_pages


def test_only_the_stop_tokens_sent_stop() -> None:
    sched = make_scheduler()
    stops = seq("stops", [1, 2], max_tokens=10, ignore_eos=False)
    ignores = seq("ignores", [1, 2], max_tokens=10, ignore_eos=True)
    sched.add(stops)
    sched.add(ignores)
    out = sched.schedule()
    sched.update(out, [EOS, EOS])
    assert stops.finish_reason == "stop"
    # The engine has no end-of-sequence list of its own to stop on.
    assert ignores.finish_reason is None


def test_a_request_that_can_never_fit_fails_loudly() -> None:
    sched = make_scheduler(num_pages=2, page_size=4, max_context=64)
    sched.add(seq("huge", list(range(1, 30))))
    with pytest.raises(RuntimeError, match="stalled"):
        sched.schedule()


def test_context_limit_ends_with_length() -> None:
    sched = make_scheduler(max_context=10)
    request = seq("a", list(range(1, 9)), max_tokens=100)
    sched.add(request)
    rng = random.Random(6)
    while sched.has_work():
        run_step(sched, rng)
    assert request.num_tokens == 10 and request.finish_reason == "length"


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_keep_the_books_balanced(seed: int) -> None:
    rng = random.Random(seed)
    page_size = rng.choice([2, 4, 8])
    sched = make_scheduler(
        # The engine's sizing guarantees one full context fits in the pool.
        num_pages=rng.randint(96 // page_size, 192 // page_size), page_size=page_size,
        lanes=rng.randint(1, 6), budget=rng.randint(8, 40), window=rng.randint(0, 16),
        max_context=96,
    )
    shared_prefix = [rng.randrange(1, 50) for _ in range(rng.randint(0, 24))]
    live: list[Sequence] = []
    finished = 0
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 12:
            prompt = shared_prefix + [rng.randrange(1, 50) for _ in range(rng.randint(1, 40))]
            prompt = prompt[: 96 - 2]
            request = seq(f"s{step}", prompt, max_tokens=rng.randint(1, 30), ignore_eos=False)
            sched.add(request)
            live.append(request)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            sched.abort([victim.request_id])
        if sched.has_work():
            run_step(sched, rng, eos_rate=0.05)
        for request in list(live):
            if request.status is SeqStatus.FINISHED:
                live.remove(request)
                finished += 1
                assert request.num_output_tokens <= request.params.max_tokens
    while sched.has_work():
        run_step(sched, rng, eos_rate=0.05)
    assert finished > 10
    assert sched.kv.pool.num_free == sched.kv.pool.num_pages
    assert sched.kv.outstanding == 0


def test_a_preempted_scoring_request_scores_no_position_twice() -> None:
    sched = make_scheduler(budget=8)
    scoring = Sequence("s", list(range(1, 21)), SamplingParams(max_tokens=0, prompt_logprobs=0))
    sched.add(scoring)
    first = sched.schedule()
    assert first.chunks[0].scored == (0, 8)
    # Preempted before its chunk completed: the recompute from position 0
    # scores only what no step has scored yet.
    sched._preempt(scoring, first)
    again = [sched.schedule() for _ in range(3)]
    scored = [chunk.scored for out in again for chunk in out.chunks]
    assert scored == [None, (8, 16), (16, 19)]
