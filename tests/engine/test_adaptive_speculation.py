"""Adaptive speculation in the pipelined loop, over the fake device: rows
whose drafts are rejected stop drafting, so the loop overlaps host and
device again; rows whose drafts are kept draft the full length; a row that
stopped probes again later and resumes when its drafts become right."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest

import protocol as p
from engine.sampling.draft_cost import CALIBRATE_AFTER, PLAIN_PAUSE, DraftCosts
from engine.sampling.draft_length import FIRST_BACKOFF
from engine.scheduling import step_times
from engine.scheduling.core import EngineCore
from tests.engine.fake_device import FakeDevice, next_token
from tests.engine.test_pipeline import expected, generate, results, run
from tests.engine.test_speculation_pipeline import (
    FixedCosts,
    OracleDrafter,
    assert_verify_steps_completed_first,
    make_core,
)

K = 4  # make_core's draft length


class RightAfterDrafter:
    """Always-wrong guesses while a sequence is shorter than `right_from`
    tokens, the toy model's own continuation from there on."""

    def __init__(self, right_from: int) -> None:
        self.right_from = right_from
        self.calls = 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        self.calls += 1
        context, draft = list(token_ids), []
        for _ in range(max_tokens):
            token = next_token(context)
            if len(context) < self.right_from:
                token = (token + 1) % 64
            draft.append(token)
            context.append(token)
        return draft


class EmptyDrafter:
    """Never finds anything to propose (an n-gram drafter without a match)."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        self.calls += 1
        return []


def overlapped_after(device: FakeDevice, launch: int) -> float:
    """The share of steps from `launch` on whose tokens were taken only
    after the next step had been launched (the host worked behind the device)."""
    later = [(taken, made) for taken, made in device.overlap if taken >= launch]
    return sum(1 for taken, made in later if made > taken) / len(later)


def outputs_of(events: list[p.EngineEvent], request_id: str) -> list[p.RequestOutput]:
    return [output for event in events if isinstance(event, p.StepOutputs)
            for output in event.outputs if output.request_id == request_id]


def four_requests(max_tokens: int) -> dict[str, p.Generate]:
    rng = random.Random(7)
    return {f"r{i}": generate(f"r{i}", [rng.randrange(64) for _ in range(5 + i)], max_tokens)
            for i in range(4)}


def assert_solo_tokens(events: list[p.EngineEvent], requests: dict[str, p.Generate],
                       max_context: int = 96) -> None:
    got = results(events)
    for request_id, request in requests.items():
        assert got[request_id] == expected(request.prompt_token_ids, request.params.max_tokens,
                                           request.params.stop_token_ids, max_context), request_id


def test_rejected_drafts_switch_rows_off_and_the_loop_overlaps_again() -> None:
    drafter = OracleDrafter(0, error=1.0, full=True)
    core, device, events = make_core(drafter)
    requests = four_requests(70)
    for request in requests.values():
        core.handle(request)
    run(core)
    assert_solo_tokens(events, requests)
    assert_verify_steps_completed_first(device)
    assert core._stats.draft_accepted_tokens_total == 0
    # Each row drafts a few times at the start and a probe now and then
    # (back-offs of 16, 32, ... tokens), not at every step.
    verify_steps = len(device.verify_launches)
    assert verify_steps <= 4 * 8, verify_steps
    assert drafter.proposed <= 4 * 20, drafter.proposed
    # Once the rows are off, most steps run behind the one before (none did
    # before issue 16); each probe of a row costs the batch two synchronous
    # steps, before it and after it.
    assert overlapped_after(device, 10) >= 0.8, device.overlap
    assert core.scheduler.kv.pool.num_used == 0


def test_a_row_that_never_finds_a_draft_lets_the_loop_overlap() -> None:
    drafter = EmptyDrafter()
    core, device, events = make_core(drafter)  # type: ignore[arg-type]
    requests = four_requests(60)
    for request in requests.values():
        core.handle(request)
    run(core)
    assert_solo_tokens(events, requests)
    assert not device.verify_launches
    assert drafter.calls <= 4 * 10, drafter.calls
    assert overlapped_after(device, 10) >= 0.85, device.overlap


def test_a_perfect_drafter_keeps_the_full_draft_length() -> None:
    core, device, events = make_core(OracleDrafter(0, error=0.0, full=True))
    core.handle(generate("a", [1, 2, 3], 81))
    run(core)
    assert results(events)["a"] == expected([1, 2, 3], 81)
    drafted = [output.num_draft_tokens for output in outputs_of(events, "a")]
    # The prompt's step gives one token, then every step drafts K and keeps
    # them all: 16 steps of 5 tokens.
    assert drafted == [0] + [K] * 16
    assert device.launches == 17


def test_a_switched_off_row_probes_and_resumes_once_its_drafts_are_right() -> None:
    prompt = [3, 1, 4, 1, 5]
    # Wrong for the first 20 output tokens, right after.
    drafter = RightAfterDrafter(len(prompt) + 20)
    core, device, events = make_core(drafter, max_context=200)  # type: ignore[arg-type]
    core.handle(generate("a", prompt, 150))
    run(core)
    assert results(events)["a"] == expected(prompt, 150, max_context=200)
    assert_verify_steps_completed_first(device)
    outputs = outputs_of(events, "a")
    position, phases = 0, []
    for output in outputs:
        phases.append((position, output.num_draft_tokens, output.num_draft_accepted))
        position += len(output.token_ids)
    # Early drafts are all rejected, then the row stops drafting...
    early = [phase for phase in phases if phase[0] < 20]
    assert all(accepted == 0 for _, _, accepted in early)
    off = [start for start, drafted, _ in phases if not drafted and start > 0]
    assert len(off) >= FIRST_BACKOFF // 2, phases
    # ...until a probe of one token finds the drafts right: from there the
    # row grows back to K and keeps every draft.
    resumed = next(index for index, (start, drafted, accepted) in enumerate(phases)
                   if start >= 20 and drafted and accepted == drafted)
    assert phases[resumed][1] == 1
    tail = phases[resumed + 4 : -2]
    assert tail and all(drafted == accepted == K for _, drafted, accepted in tail), phases
    # Its back-off was waited once: no more than 2 * FIRST_BACKOFF tokens passed.
    assert phases[resumed][0] <= 20 + 2 * FIRST_BACKOFF


def test_requests_arriving_after_rejected_ones_start_switched_off() -> None:
    """The engine's acceptance (engine/sampling/draft_length.py): once its
    drafts have been rejected a few requests long, a new request drafts
    nothing until its first probe, which comes within FIRST_BACKOFF steps on
    a multiple of it on the scheduler's clock; a fresh engine's first request
    drafts the full length from its first step."""
    drafter = OracleDrafter(0, error=1.0, full=True)
    core, _, events = make_core(drafter)
    requests = {f"r{i}": generate(f"r{i}", [i + 1, 2 * i + 3, 5], 70) for i in range(6)}
    admitted_at, resume_at = {}, {}
    for request_id, request in requests.items():  # one after another
        core.handle(request)
        core.step()  # admits it
        admitted_at[request_id] = core.scheduler.clock
        control = core.scheduler._by_id[request_id].draft_length
        assert control is not None
        resume_at[request_id] = control.resume_at if control.length == 0 else None
        run(core)
    assert_solo_tokens(events, requests)
    drafted = {request_id: [output.num_draft_tokens for output in outputs_of(events, request_id)
                            if output.num_draft_tokens] for request_id in requests}
    assert drafted["r0"][0] == K and resume_at["r0"] is None
    for request_id in ("r4", "r5"):
        # Only one-token probes, the first on the back-off's next boundary.
        assert drafted[request_id] and set(drafted[request_id]) == {1}, drafted
        resume, admitted = resume_at[request_id], admitted_at[request_id]
        assert resume is not None and resume % FIRST_BACKOFF == 0
        assert admitted < resume <= admitted + FIRST_BACKOFF
    # Fewer drafting steps in all than if each had started as the first did.
    assert sum(map(len, drafted.values())) < len(drafted["r0"]) * len(requests)


# ---- the engine's measured costs (engine/sampling/draft_cost.py) ------------


class InjectedCosts(DraftCosts):
    """Measured costs whose step times are a model's, not the fake device's:
    `fixed` + `per_token` for each row and draft token, `lost` more for a
    step without overlap (seconds). Everything else is the engine's: which
    steps it observes and how, the fit, the calibration pause."""

    __slots__ = ("fixed", "lost", "per_token", "seen")

    def __init__(self, fixed: float, per_token: float, lost: float) -> None:
        super().__init__()
        self.fixed, self.per_token, self.lost = fixed, per_token, lost
        self.seen: list[tuple[int, int, int, bool]] = []

    def observe(self, rows: int, drafts: int, drafted: int, seconds: float,
                synchronous: bool) -> None:
        self.seen.append((rows, drafts, drafted, synchronous))
        seconds = self.fixed + self.per_token * (rows + drafts) + (self.lost if synchronous else 0.0)
        super().observe(rows, drafts, drafted, seconds, synchronous)


def serve_sixty_percent(costs: DraftCosts, max_tokens: int, max_context: int = 96
                        ) -> tuple[EngineCore, FakeDevice, list[list[int]]]:
    """Four requests whose drafts are each right with probability 0.6;
    returns the engine, its device and each request's outputs' draft lengths."""
    core, device, events = make_core(OracleDrafter(0, error=0.4, full=True),
                                     num_pages=max(64, max_context + 16),
                                     max_context=max_context, costs=costs)
    requests = four_requests(max_tokens)
    for request in requests.values():
        core.handle(request)
    run(core)
    assert_solo_tokens(events, requests, max_context)
    lengths = [[output.num_draft_tokens for output in outputs_of(events, request_id)]
               for request_id in requests]
    return core, device, lengths


def test_rows_right_sixty_percent_of_the_time_draft_as_the_costs_say() -> None:
    # With the constants they draft, mostly two tokens.
    _, device, lengths = serve_sixty_percent(FixedCosts(), 70)
    every = [length for request in lengths for length in request]
    assert len(device.verify_launches) > 0.8 * device.launches
    assert every.count(2) > every.count(K)
    # Dear drafts (the 0.6B shape at batch 32 on the H200): switched off
    # within a few steps, probing now and then; the loop overlaps again.
    _, device, lengths = serve_sixty_percent(FixedCosts(0.5, 1.0), 70)
    assert len(device.verify_launches) < 0.2 * device.launches
    assert overlapped_after(device, 10) >= 0.75
    # Cheap ones (8B at batch 1): the full K nearly every step.
    _, device, lengths = serve_sixty_percent(FixedCosts(0.01, 0.02), 70)
    drafted = [length for request in lengths for length in request if length]
    assert len(device.verify_launches) > 0.9 * device.launches
    assert drafted.count(K) > 0.9 * len(drafted)


def test_an_engine_measures_its_costs_and_its_rows_follow_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From step times alone: the rows start on the constants, drafting
    every step, until the engine pauses drafting to time plain steps; then
    dear drafts are switched off and cheap ones grow to K."""
    # No step left out because this machine paused the test between steps.
    monkeypatch.setattr(step_times, "STALL_SECONDS", 60.0)
    dear = InjectedCosts(fixed=0.2e-3, per_token=0.2e-3, lost=0.3e-3)
    core, device, lengths = serve_sixty_percent(dear, 300, max_context=400)
    report = core.scheduler.draft_costs.report()
    assert report["measured"] and report["fitted"]
    # c: a drafting step's lost overlap, and its share of the steps after
    # verify steps that lost theirs without drafting.
    assert report["b"] == pytest.approx(0.2e-3)
    assert report["c"] - report["tail"] == pytest.approx(0.3e-3) and report["tail"] > 0
    # On the constants every step drafts, until the pause that times plain steps.
    launches = device.verify_launches
    run_end = next(i for i in range(1, len(launches)) if launches[i] != launches[i - 1] + 1)
    assert run_end >= CALIBRATE_AFTER
    # (Then the step gate, with the costs measured, switches the rows off at
    # once: they probe after their back-off.)
    assert launches[run_end] - launches[run_end - 1] >= PLAIN_PAUSE + 1
    late = [launch for launch in device.verify_launches if launch > device.launches // 2]
    assert len(late) < 0.15 * (device.launches // 2)
    assert overlapped_after(device, device.launches // 2) >= 0.8

    cheap = InjectedCosts(fixed=1e-3, per_token=0.005e-3, lost=0.01e-3)
    core, device, lengths = serve_sixty_percent(cheap, 300, max_context=400)
    assert core.scheduler.draft_costs.measured
    # Each request's later outputs: mostly K (the constants draft two
    # tokens at this acceptance).
    late = [length for request in lengths for length in request[len(request) // 2 : -2]]
    assert late.count(K) > 0.7 * len(late), lengths


def test_the_engine_times_decode_steps_only_and_not_its_idle_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_times, "STALL_SECONDS", 60.0)
    costs = InjectedCosts(0.001, 0.0, 0.0)
    core, device, events = make_core(OracleDrafter(0, error=1.0, full=True), costs=costs)
    core.handle(generate("a", [1, 2, 3], 60))
    run(core)
    assert results(events)["a"] == expected([1, 2, 3], 60)
    seen = costs.seen
    # Every step but the prompt's and the one after it.
    assert len(seen) == device.launches - 2
    assert all(rows == 1 for rows, _, _, _ in seen)
    # The verify steps after the first: without overlap, with their drafts.
    verifies = [(drafts, drafted, synchronous) for _, drafts, drafted, synchronous in seen
                if drafts]
    assert len(verifies) == len(device.verify_launches) - 1
    assert all(drafted == 1 and synchronous for _, drafted, synchronous in verifies)
    # Once the row is off, overlapped plain steps.
    assert sum(1 for _, drafts, _, synchronous in seen if not synchronous and not drafts) > 30

    # A loop that idles between steps (as one waiting for commands does)
    # measures nothing.
    monkeypatch.setattr(step_times, "STALL_SECONDS", 0.001)
    costs = InjectedCosts(0.001, 0.0, 0.0)
    core, device, events = make_core(OracleDrafter(0, error=1.0, full=True), costs=costs)
    core.handle(generate("a", [1, 2, 3], 20))
    while core.has_work:
        core.step()
        time.sleep(0.002)
    assert results(events)["a"] == expected([1, 2, 3], 20)
    assert costs.seen == []


class RightForDrafter:
    """The toy model's own continuation for the sequences whose prompt
    starts with `marker` (None: every sequence), always-wrong guesses for
    the others."""

    def __init__(self, marker: int | None) -> None:
        self.marker = marker

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        wrong = self.marker is not None and token_ids[0] != self.marker
        context, draft = list(token_ids), []
        for _ in range(max_tokens):
            token = next_token(context)
            if wrong:
                token = (token + 1) % 64
            draft.append(token)
            context.append(token)
        return draft


def serve_eight(drafter: RightForDrafter, costs: DraftCosts
                ) -> tuple[FakeDevice, list[list[int]]]:
    """Eight requests at once (eight lanes); each one's draft lengths."""
    core, device, events = make_core(drafter, num_pages=160, lanes=8, budget=64, costs=costs)
    rng = random.Random(3)
    requests = {f"r{i}": generate(f"r{i}", [i] + [rng.randrange(64) for _ in range(6)], 60)
                for i in range(8)}
    for request in requests.values():
        core.handle(request)
    run(core)
    assert_solo_tokens(events, requests)
    assert_verify_steps_completed_first(device)
    return device, [[output.num_draft_tokens for output in outputs_of(events, request_id)]
                    for request_id in requests]


# A row that copies pays its own draft of K = 4 (5 tokens for 4.6 shares:
# 1.09x), but in a batch of 8 the step it drafts in costs all 8 rows the
# fixed 3.2 shares for its 4 tokens: 12 tokens for 11.6 shares, 1.03x.
GATED = FixedCosts(0.1, 3.2)


def test_a_lone_row_s_drafts_wait_when_they_do_not_pay_for_the_batch_s_step() -> None:
    """Seven rows whose drafts are wrong switch off; the one that copies
    drafts only beside their probes, not every step: its drafts alone do
    not pay for the step they cost the whole batch (Scheduler._drafts_pay)."""
    device, lengths = serve_eight(RightForDrafter(marker=0), GATED)
    drafted_steps = sum(1 for length in lengths[0] if length)
    assert drafted_steps < len(lengths[0]) // 3, lengths[0]
    assert len(device.verify_launches) < 0.3 * device.launches
    assert overlapped_after(device, 12) >= 0.6


def test_rows_that_copy_together_pay_for_their_step() -> None:
    """The same costs, every row copying: 8 + 32 tokens for 8 + 3.2 + 3.2
    shares; they draft K nearly every step."""
    device, lengths = serve_eight(RightForDrafter(marker=None), GATED)
    assert len(device.verify_launches) > 0.8 * device.launches
    every = [length for request in lengths for length in request]
    assert every.count(K) > 0.7 * len(every), lengths
