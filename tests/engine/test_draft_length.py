"""The per-row draft length (engine/sampling/draft_length.py) on its own."""

from __future__ import annotations

import pytest

from engine.sampling.draft_length import (
    FIRST_BACKOFF,
    MAX_BACKOFF,
    DraftAcceptance,
    DraftLength,
    best_length,
    draft_threshold,
    probe_acceptance,
)
from tests.engine.test_speculation_pipeline import FixedCosts


def miss_until_off(control: DraftLength, output: int) -> tuple[int, int]:
    """Reject every draft from step `output` of the scheduler's clock on
    until the row switches off; returns (drafting steps taken, draft tokens
    spent). (The clock counts steps; these tests let one step pass per
    drafting step, or as many as the tokens it yields: only its order matters.)"""
    steps = spent = 0
    while control.allows(output):
        limit = control.limit(output)
        output += 1  # a rejected draft still yields the target's own token
        control.record(limit, 0, output)
        steps, spent = steps + 1, spent + limit
        assert steps < 20, "never switched off"
    return steps, spent


def test_a_row_starts_at_the_full_length_and_keeps_it_while_drafts_are_kept() -> None:
    control = DraftLength(8)
    assert control.allows(0) and control.limit(0) == 8
    for output in range(0, 200, 9):
        control.record(8, 8, output + 9)
        assert control.limit(output + 9) == 8
    assert control.acceptance == pytest.approx(1.0)


def test_rejections_shorten_the_draft_then_switch_the_row_off() -> None:
    control = DraftLength(8)
    lengths = []
    for output in range(3):
        lengths.append(control.limit(output))
        control.record(lengths[-1], 0, output + 1)
    assert lengths[0] == 8 and lengths[0] > lengths[1] >= lengths[2] >= 1
    steps, spent = miss_until_off(control, 3)
    # An always-wrong drafter costs a few steps once: six with K = 8, and
    # fewer than 20 draft tokens verified in all.
    assert 3 + steps <= 6 and sum(lengths) + spent < 20
    assert control.switch_offs == 1
    assert not control.allows(3 + steps) and control.limit(3 + steps) == 0


def test_a_switched_off_row_probes_with_one_token_after_a_growing_back_off() -> None:
    control = DraftLength(4)
    steps, _ = miss_until_off(control, 0)
    output, waits = steps, []
    for _ in range(6):
        resume = control.resume_at
        assert not control.allows(resume - 1) and control.limit(resume - 1) == 0
        waits.append(resume - output)
        # Probes fall on multiples of the back-off, so rows probe together.
        assert resume % FIRST_BACKOFF == 0
        assert control.allows(resume) and control.limit(resume) == 1
        output = resume + 1
        control.record(1, 0, output)  # the probe is wrong: off again
        assert control.limit(output) == 0
    backoffs = [FIRST_BACKOFF, 2 * FIRST_BACKOFF, 4 * FIRST_BACKOFF, 8 * FIRST_BACKOFF,
                MAX_BACKOFF, MAX_BACKOFF]
    assert all(b <= wait < 2 * b for wait, b in zip(waits, backoffs, strict=True)), waits


def test_a_kept_probe_grows_the_draft_back_to_full_length() -> None:
    control = DraftLength(4)
    output, _ = miss_until_off(control, 0)
    output = control.resume_at
    lengths = []
    for _ in range(6):
        lengths.append(control.limit(output))
        output += lengths[-1] + 1
        control.record(lengths[-1], lengths[-1], output)
    assert lengths[0] == 1 and lengths[1] == 2 and lengths[-1] == 4
    assert lengths == sorted(lengths)
    # Copying again: a later switch-off waits the first back-off only.
    output += miss_until_off(control, output)[0]
    assert FIRST_BACKOFF <= control.resume_at - output < 2 * FIRST_BACKOFF


def test_an_empty_proposal_counts_as_a_miss() -> None:
    control = DraftLength(4)
    output = 0
    while control.limit(output):
        output += 1
        control.record(0, 0, output)
        assert output < 10
    assert control.switch_offs == 1
    assert control.resume_at % FIRST_BACKOFF == 0
    assert FIRST_BACKOFF <= control.resume_at - output < 2 * FIRST_BACKOFF


def test_one_miss_inside_a_copy_only_shortens_the_draft() -> None:
    control = DraftLength(8)
    for output in range(0, 90, 9):
        control.record(8, 8, output + 9)
    control.record(8, 3, 100)
    assert 1 <= control.limit(100) <= 8 and control.allows(100)


def test_best_length_grows_with_the_acceptance() -> None:
    lengths = [best_length(p / 20, 8) for p in range(21)]
    assert lengths == sorted(lengths)
    assert lengths[0] == 0 and lengths[-1] == 8
    # A coin-flip drafter still pays with short drafts; one right a quarter
    # of the time does not.
    assert best_length(0.5, 8) >= 1 and best_length(0.25, 8) == 0
    assert best_length(1.0, 3) == 3


# ---- the engine's measured costs (DraftCosts) --------------------------------


def test_dear_drafts_switch_off_where_the_constants_draft_and_cheap_ones_draft_longer() -> None:
    # With the constants a row right 60% of the time drafts two tokens.
    assert best_length(0.6, 8) == 2
    # A draft token at half a row's share and a drafting step at one row's
    # (the 0.6B shape at batch 32 on the H200): not worth a token.
    assert best_length(0.6, 8, 0.5, 1.0) == 0
    # Nearly free (8B at batch 1): long drafts pay.
    assert best_length(0.6, 8, 0.01, 0.02) >= 6
    # A large fixed cost: one token never pays, eight kept ones do.
    assert best_length(1.0, 8, 0.05, 2.0) == 8 and best_length(1.0, 1, 0.05, 2.0) == 0


@pytest.mark.parametrize("costs", [(0.2, 0.1), (0.5, 1.0), (0.01, 0.02), (0.05, 2.0), (0.8, 0.5)],
                         ids=["constants", "dear", "cheap", "fixed-cost", "dearest"])
def test_a_kept_probe_turns_drafting_on_and_a_missed_one_keeps_it_off(
        costs: tuple[float, float]) -> None:
    """Whatever the costs, the probe's assumed acceptance sits just above
    the least at which a row drafts."""
    threshold = draft_threshold(8, *costs)
    assert best_length(threshold, 8, *costs) >= 1
    assert best_length(threshold - 0.001, 8, *costs) == 0
    for kept in (True, False):
        control = DraftLength(8, costs=FixedCosts(*costs))
        miss_until_off(control, 0)
        probe = control.resume_at
        assert control.limit(probe) == 1
        control.record(1, int(kept), probe + 1)
        assert (control.length >= 1) is kept, (costs, kept, control.acceptance)


def test_the_probe_assumes_a_little_above_the_threshold() -> None:
    # The constants' one-token threshold: 1.05 * 1.3 - 1.
    assert draft_threshold(8) == pytest.approx(0.365, abs=0.001)
    assert probe_acceptance(8) == pytest.approx(0.40, abs=0.005)
    # Where only full acceptance pays, the probe assumes it.
    assert probe_acceptance(8, 0.8, 0.5) == 1.0
    # Where nothing pays, the threshold is 1.
    assert draft_threshold(8, 1.0, 0.5) == 1.0


def test_a_new_row_weighs_its_start_with_the_engine_s_costs() -> None:
    engine = DraftAcceptance()
    for _ in range(40):
        engine.observe(0.3)  # below the constants' threshold
    assert DraftLength(8, engine).length == 0
    assert DraftLength(8, engine, costs=FixedCosts(0.01, 0.02)).length >= 1
    # A fresh engine's rows start at K, unless not even that pays.
    assert DraftLength(8, DraftAcceptance(), costs=FixedCosts(1.0, 0.5)).length == 0


def test_rows_switched_off_at_different_steps_probe_in_the_same_step() -> None:
    first, second = DraftLength(4), DraftLength(4)
    miss_until_off(first, 3)
    miss_until_off(second, 9)
    assert first.resume_at == second.resume_at == 2 * FIRST_BACKOFF


# ---- the engine's starting estimate (DraftAcceptance) -----------------------


def serve(engine: DraftAcceptance, now: int, kept: bool, max_tokens: int = 8,
          tokens: int = 128, proposes: bool = True) -> tuple[DraftLength, int]:
    """One request of `tokens` output tokens admitted at step `now` of the
    scheduler's clock, alone in the batch; every draft kept, or every one
    rejected (or, without `proposes`, none found). Returns its row and the
    clock at its end."""
    control = DraftLength(max_tokens, engine, now)
    output = 0
    while output < tokens:
        now += 1
        limit = control.limit(now)
        accepted = limit if kept else 0
        output += 1 + accepted
        if limit:
            control.record(limit if proposes else 0, accepted, now)
    return control, now


def test_a_fresh_engine_s_first_row_starts_at_the_full_length() -> None:
    engine = DraftAcceptance()
    assert engine.acceptance == 1.0
    control = DraftLength(8, engine, 5)
    assert control.length == 8 and control.allows(5) and control.limit(5) == 8
    # Exactly as a row without the engine's estimate.
    alone = DraftLength(8)
    for output in range(3):
        assert control.limit(output) == alone.limit(output)
        control.record(control.length, 0, output + 1)
        alone.record(alone.length, 0, output + 1)
        assert control.acceptance == alone.acceptance


@pytest.mark.parametrize("proposes", [True, False], ids=["rejected", "none-found"])
def test_after_rows_whose_drafts_all_missed_a_new_row_starts_off(proposes: bool) -> None:
    engine, now = DraftAcceptance(), 0
    for _ in range(4):
        _, now = serve(engine, now, kept=False, proposes=proposes)
    now += 5  # admitted off a boundary
    control = DraftLength(8, engine, now)
    assert control.length == 0 and not control.allows(now) and control.limit(now) == 0
    # Its first probe comes within FIRST_BACKOFF steps, on a boundary.
    assert control.resume_at % FIRST_BACKOFF == 0
    assert now < control.resume_at <= now + FIRST_BACKOFF
    assert control.allows(control.resume_at) and control.limit(control.resume_at) == 1
    # Starting off counts as the first back-off: a failed probe waits the second.
    probe = control.resume_at
    control.record(1, 0, probe + 1)
    assert control.resume_at % (2 * FIRST_BACKOFF) == 0
    assert 2 * FIRST_BACKOFF <= control.resume_at - (probe + 1) < 4 * FIRST_BACKOFF


def test_rows_that_start_off_near_each_other_probe_together() -> None:
    engine, now = DraftAcceptance(), 0
    for _ in range(4):
        _, now = serve(engine, now, kept=False)
    base = (now // FIRST_BACKOFF + 1) * FIRST_BACKOFF
    first, second = DraftLength(8, engine, base), DraftLength(8, engine, base + 9)
    assert first.resume_at == second.resume_at == base + FIRST_BACKOFF


def test_after_rows_whose_drafts_were_kept_a_new_row_starts_at_the_full_length() -> None:
    engine, now = DraftAcceptance(), 0
    for _ in range(3):
        _, now = serve(engine, now, kept=True)
    assert engine.acceptance == pytest.approx(1.0)
    control = DraftLength(8, engine, now)
    assert control.length == 8 and control.limit(now) == 8


@pytest.mark.parametrize("max_tokens", [2, 4, 8])
def test_the_estimate_follows_a_change_of_workload_within_a_few_requests(
        max_tokens: int) -> None:
    """The numbers the module docstring gives: after misses, one copying
    request turns new rows on; after copying, the fourth request in a row
    whose drafts all miss starts off."""
    engine, now = DraftAcceptance(), 0
    for _ in range(6):
        _, now = serve(engine, now, kept=False, max_tokens=max_tokens)
    copying, now = serve(engine, now, kept=True, max_tokens=max_tokens)
    assert copying.max_tokens == max_tokens and copying.length == max_tokens
    assert DraftLength(max_tokens, engine, now).length == max_tokens
    for _ in range(3):
        _, now = serve(engine, now, kept=True, max_tokens=max_tokens)
    starts = []  # what each new request starts with
    for _ in range(4):
        starts.append(DraftLength(max_tokens, engine, now).length)
        _, now = serve(engine, now, kept=False, max_tokens=max_tokens)
    assert starts[0] == max_tokens and starts[-1] == 0, starts
    assert starts == sorted(starts, reverse=True) and starts[2] < max_tokens, starts


def test_expected_kept_is_the_sum_of_the_acceptance_s_powers() -> None:
    from engine.sampling.draft_length import expected_kept

    for acceptance in (0.0, 0.3, 0.6, 0.999, 1.0):
        for tokens in (0, 1, 4, 8):
            assert expected_kept(acceptance, tokens) == pytest.approx(
                sum(acceptance**i for i in range(1, tokens + 1)))
