"""Adaptive speculation in the pipelined loop, over the fake device: rows
whose drafts are rejected stop drafting, so the loop overlaps host and
device again; rows whose drafts are kept draft the full length; a row that
stopped probes again later and resumes when its drafts become right."""

from __future__ import annotations

import random
from collections.abc import Sequence

import protocol as p
from engine.sampling.draft_length import FIRST_BACKOFF
from tests.engine.fake_device import FakeDevice, next_token
from tests.engine.test_pipeline import expected, generate, results, run
from tests.engine.test_speculation_pipeline import (
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


def assert_solo_tokens(events: list[p.EngineEvent], requests: dict[str, p.Generate]) -> None:
    got = results(events)
    for request_id, request in requests.items():
        assert got[request_id] == expected(request.prompt_token_ids, request.params.max_tokens,
                                           request.params.stop_token_ids), request_id


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
