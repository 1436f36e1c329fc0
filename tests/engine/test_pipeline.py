"""The engine loop as a pipeline, driven over a fake device (tests/engine/fake_device.py).

Step N + 1 is scheduled and launched before step N's tokens reach the host.
These tests check the rules that makes safe: every request's tokens are what
its model gives it alone, whatever it shares a step with, under preemption,
aborts and stops that the host learns of one step late, and grammar masks
that must see the token before.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
import torch

import protocol as p
from engine.kv.block_hash import kv_fingerprint
from engine.kv.block_pool import BlockPool
from engine.kv.kv_manager import KVManager
from engine.sampling.grammar import Verdict
from engine.sampling.sampler import Sampler
from engine.sampling.token_mask import TokenMask
from engine.scheduling.core import EngineCore
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence
from tests.engine.fake_device import VOCAB, FakeDevice, next_token

STOP = 7


def make_core(num_pages: int = 64, page_size: int = 4, lanes: int = 4, budget: int = 16,
              max_context: int = 96, window: int = 8
              ) -> tuple[EngineCore, FakeDevice, list[p.EngineEvent]]:
    kv = KVManager(BlockPool(num_pages, page_size), kv_fingerprint("fake"), window, max_context)
    scheduler = Scheduler(kv, max_concurrency=lanes, max_batched_tokens=budget,
                          max_context=max_context)
    device = FakeDevice(scheduler, lanes)
    events: list[p.EngineEvent] = []
    core = EngineCore(device, scheduler, Sampler(torch.device("cpu")),  # type: ignore[arg-type]
                      vocab_size=VOCAB, emit=events.append)
    return core, device, events


def expected(prompt: list[int], max_tokens: int, stops: Iterable[int] = (),
             max_context: int = 96) -> tuple[list[int], str]:
    """The request's tokens and finish reason with the toy model, alone."""
    context, out = list(prompt), []
    while True:
        token = next_token(context)
        out.append(token)
        context.append(token)
        if token in stops:
            return out, "stop"
        if len(out) >= max_tokens or len(context) >= max_context:
            return out, "length"


def generate(request_id: str, prompt: list[int], max_tokens: int, stops: Iterable[int] = (),
             grammar: p.GrammarSpec | None = None, report_progress: bool = False) -> p.Generate:
    params = p.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                              stop_token_ids=list(stops), grammar=grammar,
                              report_progress=report_progress)
    return p.Generate(request_id, prompt, params)


def run(core: EngineCore, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not core.has_work:
            return
        core.step()
        core.scheduler.check_invariants()
    raise AssertionError("the engine did not finish")


def results(events: list[p.EngineEvent]) -> dict[str, tuple[list[int], str | None]]:
    """Per request: its tokens and finish reason; asserts nothing follows a finish."""
    found: dict[str, tuple[list[int], str | None]] = {}
    for event in events:
        if not isinstance(event, p.StepOutputs):
            continue
        for output in event.outputs:
            tokens, reason = found.get(output.request_id, ([], None))
            assert reason is None, f"{output.request_id} got output after finishing ({reason})"
            found[output.request_id] = (tokens + list(output.token_ids), output.finish_reason)
    return found


def random_requests(rng: random.Random, count: int) -> dict[str, p.Generate]:
    return {
        f"r{i}": generate(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
                          rng.randrange(1, 25), stops=[STOP] if rng.random() < 0.5 else [])
        for i in range(count)
    }


@pytest.mark.parametrize("seed", range(6))
def test_every_request_gets_its_solo_tokens_in_a_busy_pipeline(seed: int) -> None:
    rng = random.Random(seed)
    core, device, events = make_core()
    requests = random_requests(rng, 12)
    for request in requests.values():
        core.handle(request)
    run(core)
    got = results(events)
    for request_id, request in requests.items():
        want = expected(request.prompt_token_ids, request.params.max_tokens,
                        request.params.stop_token_ids)
        assert got[request_id] == want, request_id
    # Decode steps overlapped: most steps' tokens were taken with the next step launched.
    ahead = sum(1 for launch, made in device.overlap if made > launch)
    assert ahead >= len(device.overlap) * 0.8, device.overlap


@pytest.mark.parametrize("seed", range(4))
def test_preemption_with_tokens_still_on_the_device(seed: int) -> None:
    rng = random.Random(100 + seed)
    # 12 pages of 4 tokens for 4 lanes, no output window reserved: decode
    # growth preempts often.
    core, _, events = make_core(num_pages=12, lanes=4, max_context=40, window=0)
    requests = {
        f"r{i}": generate(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 12))],
                          rng.randrange(8, 20), report_progress=True)
        for i in range(8)
    }
    for request in requests.values():
        core.handle(request)
    run(core)
    assert core.scheduler.num_preemptions > 0
    # Prompt progress is reported while the prompt is processed, never again
    # when a preempted sequence recomputes it after its first tokens.
    seen_tokens: set[str] = set()
    for event in events:
        for output in event.outputs if isinstance(event, p.StepOutputs) else ():
            if output.token_ids:
                seen_tokens.add(output.request_id)
            elif output.finish_reason is None:
                assert output.request_id not in seen_tokens, output
    got = results(events)
    for request_id, request in requests.items():
        assert got[request_id] == expected(request.prompt_token_ids, request.params.max_tokens,
                                           max_context=40), request_id


def test_an_abort_while_its_step_is_on_the_device_ends_it_there() -> None:
    core, _, events = make_core()
    core.handle(generate("a", [1, 2, 3], 50))
    core.handle(generate("b", [4, 5, 6, 7, 8], 12))
    for _ in range(4):
        core.step()
    assert core._in_flight is not None and any(
        chunk.seq.request_id == "a" for chunk in core._in_flight.out.chunks)
    core.handle(p.Abort(["a"]))
    run(core)
    got = results(events)
    assert got["a"][1] == "abort"
    # The aborted tokens are a prefix of a's solo run; b never noticed.
    solo_a, _ = expected([1, 2, 3], 50)
    assert got["a"][0] == solo_a[: len(got["a"][0])]
    assert got["b"] == expected([4, 5, 6, 7, 8], 12)
    assert core.scheduler.kv.pool.num_used == 0


def test_a_stop_seen_one_step_late_drops_the_extra_step() -> None:
    # Find a prompt whose solo run stops early on STOP.
    rng = random.Random(5)
    while True:
        prompt = [rng.randrange(VOCAB) for _ in range(6)]
        tokens, reason = expected(prompt, 40, [STOP])
        if reason == "stop" and 2 <= len(tokens) <= 10:
            break
    core, device, events = make_core()
    core.handle(generate("s", prompt, 40, [STOP]))
    run(core)
    assert results(events)["s"] == (tokens, "stop")
    # The step after the stop was launched already (its work dropped), and
    # nothing was launched after that.
    assert device.launches == 1 + len(tokens)
    assert core.scheduler.kv.pool.num_used == 0


def test_a_request_ending_by_length_is_not_scheduled_past_its_last_token() -> None:
    core, device, events = make_core()
    core.handle(generate("n", [3, 1, 4], 5))
    run(core)
    assert results(events)["n"] == expected([3, 1, 4], 5)
    assert device.launches == 5  # the prompt's step, then four decode steps


class CountingGrammar:
    """A grammar stand-in: a row may only take (its previous token + 1) mod
    VOCAB, and is complete after five tokens. A mask built before the step
    before had its token accepted would allow the wrong token."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.calls: list[str] = []

    def __len__(self) -> int:
        return len(self.counts)

    def admit(self, request_id: str, spec: p.GrammarSpec) -> None:
        self.counts[request_id] = 0

    def forget(self, request_id: str) -> None:
        self.counts.pop(request_id, None)
        self.last.pop(request_id, None)

    def fill(self, seqs: list[Sequence]) -> TokenMask | None:
        self.calls.append("fill")
        words = (VOCAB + 31) // 32
        bitmask = torch.zeros((len(seqs), words), dtype=torch.int32)
        rows = []
        for row, seq in enumerate(seqs):
            last = self.last.get(seq.request_id)
            if last is None:
                continue
            allowed = (last + 1) % VOCAB
            bitmask[row, allowed // 32] = 1 << (allowed % 32)
            rows.append(row)
        return TokenMask(bitmask, rows) if rows else None

    def accept(self, seqs: list[Sequence], tokens: list[int], drafted: object = None) -> Verdict:
        assert drafted is None, "no drafts here"
        self.calls.append("accept")
        verdict = Verdict()
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.request_id not in self.counts:
                continue
            self.last[seq.request_id] = token
            self.counts[seq.request_id] += 1
            if self.counts[seq.request_id] == 5:
                verdict.completed.add(seq.request_id)
        return verdict


def test_grammar_masks_are_built_after_the_token_before_is_accepted() -> None:
    core, device, events = make_core()
    grammar = CountingGrammar()
    core.grammar = grammar  # type: ignore[assignment]
    spec = p.GrammarSpec(kind="regex", source="x")
    core.handle(generate("g", [9, 9, 9], 50, grammar=spec))
    core.handle(generate("free", [2, 7, 1, 8], 10))
    run(core)
    got = results(events)
    first = next_token([9, 9, 9])
    assert got["g"] == ([(first + i) % VOCAB for i in range(5)], "stop")
    assert got["free"] == expected([2, 7, 1, 8], 10)  # masks stayed on their row
    assert device.masks_seen and all(rows == [0] for _, rows in device.masks_seen)
    # In the steps both decode, the plain row is sampled before the step
    # before completes; the grammar row after it (its mask needs that token).
    order = device.events
    split = [launch for kind, launch, rows in order
             if kind == "sample" and rows == (1,) and launch > 1]
    assert len(split) >= 3, order
    for launch in split:
        first = order.index(("sample", launch, (1,)))
        taken = order.index(("take", launch - 1, ()))
        second = order.index(("sample", launch, (0,)))
        assert first < taken < second, order


def test_a_penalty_row_is_sampled_ahead_like_a_plain_one() -> None:
    # Penalty counts live on the device (engine/sampling/penalty_state.py):
    # the row needs nothing from the host, so it is never put off.
    core, device, events = make_core()
    params = p.SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5,
                              frequency_penalty=0.3, repetition_penalty=1.2, penalty_last_n=4)
    core.handle(p.Generate("pen", [3, 5, 7], params))
    run(core)
    # (The toy device's tokens do not read logits: they are the solo run's.)
    assert results(events)["pen"] == expected([3, 5, 7], 12)
    early = {launch: sampled_early(device, launch) for launch in range(2, device.launches + 1)}
    assert len(early) == 11 and all(early.values()), early


# ---- forced tokens (engine/sampling/forced_tokens.py) ------------------------

def expected_with_budget(prompt: list[int], max_tokens: int, budget: p.ReasoningBudget
                         ) -> list[int]:
    """The toy model's tokens alone, with the reasoning budget's rules applied
    one token at a time: the model's close within the budget, else end_ids at
    index `budget`; after_ids once the block is closed."""
    context, out = list(prompt), []
    start, run = -1, ()
    close = budget.close_ids
    while len(out) < max_tokens:
        index = len(out)
        if start < 0 and 0 <= budget.budget <= index:
            start, run = budget.budget, (*budget.end_ids, *budget.after_ids)
        forced = start >= 0 and start <= index < start + len(run)
        token = run[index - start] if forced else next_token(context)
        out.append(token)
        context.append(token)
        if start < 0 and out[-len(close):] == close:
            start, run = index + 1, tuple(budget.after_ids)
    return out


def unused_token(prompt: list[int], count: int) -> int:
    """A token the toy model does not write in its first `count` tokens for prompt."""
    seen = set(expected(prompt, count)[0])
    return next(t for t in range(VOCAB) if t not in seen)


def budgeted(request_id: str, prompt: list[int], max_tokens: int,
             budget: p.ReasoningBudget) -> p.Generate:
    params = p.SamplingParams(max_tokens=max_tokens, temperature=0.0, reasoning=budget)
    return p.Generate(request_id, prompt, params)


def sampled_early(device: FakeDevice, launch: int) -> bool:
    """Whether some row of `launch` was sampled before the launch before had its tokens taken."""
    order = device.events
    taken = order.index(("take", launch - 1, ()))
    return any(kind == "sample" and at == launch and i < taken
               for i, (kind, at, _) in enumerate(order))


def test_a_spent_budget_forces_the_end_ids_and_nothing_else_changes() -> None:
    prompt = [5, 9, 2, 6]
    close = unused_token(prompt, 40)
    budget = p.ReasoningBudget(budget=6, close_ids=[close], end_ids=[11, close, 12])
    core, device, events = make_core()
    core.handle(budgeted("b", prompt, 20, budget))
    core.handle(generate("free", [1, 2, 3], 20))
    run(core)
    got = results(events)
    solo, _ = expected(prompt, 20)
    want = expected_with_budget(prompt, 20, budget)
    assert want[:6] == solo[:6] and want[6:9] == [11, close, 12]
    assert got["b"] == (want, "length")
    assert got["free"] == expected([1, 2, 3], 20)  # its tokens untouched
    assert [token for _, token in device.forced_seen] == [11, close, 12]


def test_a_block_the_model_closes_in_time_forces_nothing() -> None:
    prompt = [3, 3, 8]
    solo, _ = expected(prompt, 16)
    # The model's own token at index 5 is taken as its closing delimiter: the
    # block closes within a budget of 6, decided by that token only once it
    # reached the host (the step sampling index 6 was put off for it).
    close = solo[5]
    assert close not in solo[:5]
    budget = p.ReasoningBudget(budget=6, close_ids=[close], end_ids=[11, close, 12])
    core, device, events = make_core()
    core.handle(budgeted("b", prompt, 16, budget))
    run(core)
    assert results(events)["b"] == (solo, "length")
    assert device.forced_seen == []


def test_after_ids_follow_the_models_own_close() -> None:
    prompt = [4, 1, 7, 7]
    solo, _ = expected(prompt, 30)
    close = solo[2]
    assert close not in solo[:2]
    budget = p.ReasoningBudget(budget=-1, close_ids=[close], after_ids=[20, 21])
    core, _, events = make_core()
    core.handle(budgeted("t", prompt, 12, budget))
    run(core)
    want = expected_with_budget(prompt, 12, budget)
    assert want[:5] == [*solo[:3], 20, 21]
    assert results(events)["t"] == (want, "length")


def test_a_budgeted_row_is_sampled_ahead_until_its_budget_is_near() -> None:
    prompt = [2, 4, 6, 8]
    close = unused_token(prompt, 40)
    budget = p.ReasoningBudget(budget=8, close_ids=[close], end_ids=[close])
    core, device, events = make_core()
    core.handle(budgeted("b", prompt, 14, budget))
    run(core)
    assert results(events)["b"] == (expected_with_budget(prompt, 14, budget), "length")
    # Launch L samples output index L - 1. Before the budget the row is
    # sampled before the step before completes; from the budget on (where a
    # token may be forced) after it; once the end is forced, ahead again.
    early = {launch: sampled_early(device, launch) for launch in range(2, device.launches + 1)}
    assert all(early[launch] for launch in range(2, 9)), early
    assert not early[9], early  # index 8: forced
    assert all(early[launch] for launch in range(11, device.launches + 1)), early


@pytest.mark.parametrize("seed", range(4))
def test_budgets_in_a_busy_pipeline_with_preemption(seed: int) -> None:
    rng = random.Random(300 + seed)
    core, _, events = make_core(num_pages=14, lanes=4, max_context=48, window=0)
    requests: dict[str, p.Generate] = {}
    for i in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 10))]
        max_tokens = rng.randrange(6, 24)
        if i % 2:
            requests[f"r{i}"] = generate(f"r{i}", prompt, max_tokens)
            continue
        solo, _ = expected(prompt, max_tokens, max_context=48)
        # Half close the block themselves (with an after run), half run out.
        close = solo[rng.randrange(len(solo))] if i % 4 == 0 else unused_token(prompt, 48)
        budget = p.ReasoningBudget(budget=rng.randrange(0, 8), close_ids=[close],
                                   end_ids=[60, close, 61], after_ids=[62] if i % 4 == 0 else [])
        requests[f"r{i}"] = budgeted(f"r{i}", prompt, max_tokens, budget)
    for request in requests.values():
        core.handle(request)
    run(core)
    assert core.scheduler.num_preemptions > 0
    got = results(events)
    for request_id, request in requests.items():
        params = request.params
        if params.reasoning is None:
            want = expected(request.prompt_token_ids, params.max_tokens, max_context=48)[0]
        else:
            want = expected_with_budget(request.prompt_token_ids, params.max_tokens, params.reasoning)
        assert got[request_id][0] == want[:len(got[request_id][0])], request_id
        assert len(got[request_id][0]) == min(params.max_tokens, 48 - len(request.prompt_token_ids))


def test_a_budget_with_ids_outside_the_vocabulary_is_refused() -> None:
    core, _, events = make_core()
    core.handle(budgeted("x", [1, 2], 5, p.ReasoningBudget(budget=2, close_ids=[3],
                                                           end_ids=[VOCAB + 1])))
    (error,) = events
    assert isinstance(error, p.RequestError) and "end_ids" in error.message
    assert not core.has_work
