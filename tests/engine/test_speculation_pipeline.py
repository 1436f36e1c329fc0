"""Speculative decoding in the pipelined loop, over the fake device
(tests/engine/fake_device.py), which enforces the loop's ordering rules.

An oracle drafter guesses the toy model's real continuation, wrong at random
positions, so every case mixes accepted and rejected drafts: the tokens must
still be each request's solo tokens, no page may leak, and a step that
verified drafts must be on the host before anything is scheduled after it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

import protocol as p
from engine.kv.block_hash import kv_fingerprint
from engine.kv.block_pool import BlockPool
from engine.kv.kv_manager import KVManager
from engine.sampling.draft_cost import DraftCosts
from engine.sampling.sampler import Sampler
from engine.scheduling.core import EngineCore
from engine.scheduling.scheduler import Scheduler
from tests.engine.fake_device import VOCAB, FakeDevice, next_token
from tests.engine.fixed_costs import FixedCosts
from tests.engine.test_pipeline import STOP, expected, generate, random_requests, results, run


class OracleDrafter:
    """The toy model's own next tokens, each wrong with probability `error`;
    a random number of them, or as many as allowed (`full`)."""

    def __init__(self, seed: int, error: float, full: bool = False) -> None:
        self.rng = random.Random(seed)
        self.error = error
        self.full = full
        self.proposed = 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        assert all(token >= 0 for token in token_ids), "drafted from a placeholder"
        context, draft = list(token_ids), []
        count = max_tokens if self.full else self.rng.randrange(max_tokens + 1)
        for _ in range(count):
            token = next_token(context)
            if self.rng.random() < self.error:
                token = (token + 1) % VOCAB
            draft.append(token)
            context.append(token)
        self.proposed += len(draft)
        return draft


def make_core(drafter: OracleDrafter, num_pages: int = 64, lanes: int = 4, budget: int = 16,
              max_context: int = 96, window: int = 8, max_verify_rows: int = 0,
              costs: DraftCosts | None = None
              ) -> tuple[EngineCore, FakeDevice, list[p.EngineEvent]]:
    """An engine over the fake device; its draft costs are `costs`, or the
    constants (FixedCosts)."""
    kv = KVManager(BlockPool(num_pages, 4), kv_fingerprint("fake"), window, max_context)
    scheduler = Scheduler(kv, max_concurrency=lanes, max_batched_tokens=budget,
                          max_context=max_context, drafter=drafter, draft_tokens=4,
                          max_verify_rows=max_verify_rows)
    scheduler.draft_costs = FixedCosts() if costs is None else costs
    device = FakeDevice(scheduler, lanes)
    events: list[p.EngineEvent] = []
    core = EngineCore(device, scheduler, Sampler(torch.device("cpu")),  # type: ignore[arg-type]
                      vocab_size=VOCAB, emit=events.append)
    return core, device, events


def assert_verify_steps_completed_first(device: FakeDevice) -> None:
    """No launch followed a verify step before its tokens were taken."""
    made_by = dict(device.overlap)
    assert device.verify_launches
    for launch in device.verify_launches:
        assert made_by[launch] == launch, (launch, made_by[launch])


@pytest.mark.parametrize("seed", range(6))
def test_drafted_requests_get_their_solo_tokens(seed: int) -> None:
    drafter = OracleDrafter(seed, error=0.3)
    core, device, events = make_core(drafter)
    requests = random_requests(random.Random(seed), 12)
    for request in requests.values():
        core.handle(request)
    run(core)
    got = results(events)
    for request_id, request in requests.items():
        assert got[request_id] == expected(request.prompt_token_ids, request.params.max_tokens,
                                           request.params.stop_token_ids), request_id
    assert_verify_steps_completed_first(device)
    stats = core._stats
    assert 0 < stats.draft_accepted_tokens_total < stats.draft_tokens_total == drafter.proposed
    assert core.scheduler.kv.pool.num_used == 0


def test_a_verify_step_beside_a_new_prompt_completes_before_the_next_step() -> None:
    """With max_verify_rows, rows stop wanting drafts while a prompt is being
    prefilled; a verify step launched in the step that admitted that prompt
    must still be on the host before the next step is scheduled."""
    core, device, events = make_core(OracleDrafter(5, error=0.3, full=True), budget=12,
                                     max_verify_rows=16)
    first = generate("first", [1, 2, 3], 20)
    core.handle(first)
    core.step()
    core.step()
    later = generate("later", list(range(10, 40)), 10)  # prefilled over several steps
    core.handle(later)
    run(core)
    got = results(events)
    for request in (first, later):
        assert got[request.request_id] == expected(request.prompt_token_ids,
                                                   request.params.max_tokens)
    assert_verify_steps_completed_first(device)
    assert core._stats.draft_accepted_tokens_total > 0
    assert core.scheduler.kv.pool.num_used == 0


def test_a_prompt_admitted_while_rows_could_draft_gets_the_whole_step_budget() -> None:
    """The verify budget (max_verify_rows) is for drafts: a prompt arriving
    while running rows could draft is admitted first, with its full chunk,
    and prefilled as it would be without speculation (a cut chunk computes
    other numbers, and plain and drafted output would part)."""
    core, _, _ = make_core(OracleDrafter(2, error=0.3, full=True), budget=24,
                           max_verify_rows=8)
    core.handle(generate("first", [1, 2, 3], 30))
    for _ in range(3):
        core.step()  # "first" decodes, with drafts
    scheduler = core.scheduler
    assert not scheduler.waiting and scheduler.wants_drafts()
    core.handle(generate("later", list(range(10, 50)), 5))
    assert not scheduler.wants_drafts()  # admission first
    out = scheduler.schedule()
    chunks = {chunk.seq.request_id: chunk for chunk in out.chunks}
    assert chunks["later"].num_tokens == 24 - 1 and not chunks["first"].draft


@pytest.mark.parametrize("seed", range(4))
def test_drafts_under_preemption_and_page_pressure(seed: int) -> None:
    rng = random.Random(100 + seed)
    core, device, events = make_core(OracleDrafter(seed, error=0.2), num_pages=12,
                                     max_context=40, window=0)
    requests = {
        f"r{i}": generate(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 12))],
                          rng.randrange(8, 20), stops=[STOP] if i % 2 else [])
        for i in range(8)
    }
    for request in requests.values():
        core.handle(request)
    run(core)
    assert core.scheduler.num_preemptions > 0
    got = results(events)
    for request_id, request in requests.items():
        assert got[request_id] == expected(request.prompt_token_ids, request.params.max_tokens,
                                           request.params.stop_token_ids, max_context=40)
    assert_verify_steps_completed_first(device)
    assert core.scheduler.kv.pool.num_used == 0


def test_a_perfect_drafter_yields_its_draft_and_one_more_per_step() -> None:
    core, device, events = make_core(OracleDrafter(0, error=0.0, full=True))
    core.handle(generate("a", [1, 2, 3], 21))
    run(core)
    assert results(events)["a"] == expected([1, 2, 3], 21)
    # The prompt's step gives 1 token; then 4 steps of 4 drafts + 1 give 20.
    assert device.launches == 5
    assert core._stats.draft_accepted_tokens_total == 16


def test_rows_that_cannot_draft_keep_the_pipeline_overlapped() -> None:
    core, device, events = make_core(OracleDrafter(1, error=0.0))
    rng = random.Random(3)
    requests = {}
    for i in range(6):
        # Rows that score their prompt never draft (the toy device scores nothing).
        params = p.SamplingParams(max_tokens=15, temperature=0.0, prompt_logprobs=0)
        requests[f"s{i}"] = p.Generate(f"s{i}", [rng.randrange(VOCAB) for _ in range(5)], params)
    for request in requests.values():
        core.handle(request)
    run(core)
    got = results(events)
    for request_id, request in requests.items():
        assert got[request_id] == expected(request.prompt_token_ids, 15), request_id
    assert not device.verify_launches
    ahead = sum(1 for launch, made in device.overlap if made > launch)
    assert ahead >= len(device.overlap) * 0.8, device.overlap


def test_a_short_verify_budget_goes_to_different_rows_each_step() -> None:
    """Four rows that each want 4 drafts share a verify budget of 4 draft
    tokens (max_verify_rows 8): the row served first moves on every step, so
    every row drafts within a few steps and their tokens stay exact. (In
    running order the first row would take the whole budget every step.)"""
    core, device, events = make_core(OracleDrafter(7, error=0.0, full=True), budget=32,
                                     max_verify_rows=8)
    requests = [generate(f"r{i}", [i + 1, i + 2, i + 3], 24) for i in range(4)]
    for request in requests:
        core.handle(request)
    drafted_by: list[set[str]] = []
    for _ in range(1_000):
        if not core.has_work:
            break
        core.step()
        flight = core._in_flight
        if flight is not None and any(chunk.draft for chunk in flight.out.chunks):
            drafted_by.append({chunk.seq.request_id for chunk in flight.out.chunks
                               if chunk.draft})
    assert len(drafted_by) >= 4
    assert set().union(*drafted_by[:4]) == {request.request_id for request in requests}
    got = results(events)
    for request in requests:
        assert got[request.request_id] == expected(request.prompt_token_ids,
                                                   request.params.max_tokens)
    assert_verify_steps_completed_first(device)
