"""The engine's measured draft costs (engine/sampling/draft_cost.py) on
their own, from synthetic step times."""

from __future__ import annotations

import pytest

from engine.sampling.draft_cost import (
    CALIBRATE_AFTER,
    CLIP,
    MAX_STEP_COST,
    MAX_VERIFY_COST,
    PLAIN_PAUSE,
    PLAIN_WINDOW,
    DraftCosts,
)
from engine.sampling.draft_length import STEP_COST, VERIFY_COST


def plain(costs: DraftCosts, steps: int, rows: int, fixed: float, per_token: float) -> None:
    """Overlapped steps without drafts: fixed + per_token * rows seconds each."""
    for _ in range(steps):
        costs.observe(rows, 0, 0, fixed + per_token * rows, False)


def drafting(costs: DraftCosts, steps: int, rows: int, drafted: int, fixed: float,
             per_token: float, lost: float, drafts: list[int]) -> None:
    """Steps without overlap (lost seconds more), cycling through the given
    draft token counts."""
    for step in range(steps):
        count = drafts[step % len(drafts)]
        costs.observe(rows, count, drafted if count else 0,
                      fixed + per_token * (rows + count) + lost, True)


def test_it_fits_verify_and_step_costs_from_step_times() -> None:
    # Batch 8: a plain step takes 10 ms (2 ms fixed, 1 ms a row); a step
    # without overlap 3 ms more, and 1 ms per draft token; 4 rows draft.
    costs = DraftCosts()
    plain(costs, 40, 8, 0.002, 0.001)
    drafting(costs, 40, 8, 4, 0.002, 0.001, 0.003, [4, 8, 12, 16])
    report = costs.report()
    assert report["measured"] and report["fitted"]
    assert report["b"] == pytest.approx(0.001)
    assert report["c"] == pytest.approx(0.003) and report["tail"] == 0
    assert report["t_plain"] == pytest.approx(0.010)
    # A draft token costs 1 ms of a row's 1.25 ms share; the 3 ms fixed
    # cost shared by the 4 rows that draft: 0.75 ms each. The step's
    # drafts together pay all of it: 2.4 shares.
    assert costs.costs == pytest.approx((0.8, 0.6))
    assert costs.step_shares == pytest.approx(2.4)


def test_steps_without_overlap_or_drafts_are_drafting_s_cost() -> None:
    """The step after a verify step loses the overlap without drafting: it
    is no drafting step (it stays out of the fit), but its time beyond a
    plain step's is spread over the drafting steps, in c."""
    costs = DraftCosts()
    plain(costs, 40, 8, 0.002, 0.001)
    # Each drafting step followed by one without drafts that took 2 ms more
    # than a plain step.
    for count in [4, 8, 12, 16] * 10:
        drafting(costs, 1, 8, 4, 0.002, 0.001, 0.003, [count])
        costs.observe(8, 0, 0, 0.010 + 0.002, True)
    report = costs.report()
    assert report["b"] == pytest.approx(0.001)
    # 2 ms of tail per drafting step, but the last one's is yet to come.
    assert report["tail"] == pytest.approx(0.002, rel=0.03)
    assert report["c"] == pytest.approx(0.003 + report["tail"])
    assert costs.step_shares == pytest.approx((0.003 + report["tail"]) * 8 / 0.010)
    assert costs.costs[1] == pytest.approx(costs.step_shares / 4)


def test_the_rows_of_a_step_are_priced_like_its_draft_tokens() -> None:
    """Plain steps measured at 8 rows, drafting steps at 4 to 12 rows:
    the fit reads b from both, and T_plain at another batch moves by b a row."""
    costs = DraftCosts()
    plain(costs, 40, 8, 0.002, 0.001)
    for rows in (4, 6, 12, 10, 5, 9, 7, 11) * 6:
        drafting(costs, 1, rows, rows, 0.002, 0.001, 0.003, [2 * rows])
    plain(costs, 1, 8, 0.002, 0.001)  # the batch is 8 rows again
    drafting(costs, 1, 8, 2, 0.002, 0.001, 0.003, [6])  # and 2 of them drafted last
    assert costs.report()["b"] == pytest.approx(0.001)
    assert costs.report()["c"] == pytest.approx(0.003)
    assert costs.costs == pytest.approx((0.8, 1.2))
    # At 16 rows (one more step there, not enough to move the plain
    # average far): a plain step takes 18 ms by the model.
    drafting(costs, 1, 16, 16, 0.002, 0.001, 0.003, [4])
    report = costs.report()
    assert report["t_plain"] == pytest.approx(0.018, rel=0.01)
    assert costs.costs == pytest.approx((0.001 * 16 / 0.018, 0.003 / 0.018), rel=0.02)


def test_the_constants_hold_until_both_kinds_of_steps_are_measured() -> None:
    costs = DraftCosts()
    assert costs.costs == (VERIFY_COST, STEP_COST) and not costs.measured
    drafting(costs, 100, 4, 4, 0.001, 0.001, 0.004, [1, 8])
    assert costs.costs == (VERIFY_COST, STEP_COST) and not costs.report()["measured"]
    plain(costs, 3, 4, 0.001, 0.001)
    assert costs.costs == (VERIFY_COST, STEP_COST)
    plain(costs, 2, 4, 0.001, 0.001)
    assert costs.measured and costs.costs != (VERIFY_COST, STEP_COST)

    costs = DraftCosts()
    plain(costs, 100, 4, 0.001, 0.001)
    drafting(costs, 7, 4, 4, 0.001, 0.001, 0.004, [1, 8])
    drafting(costs, 20, 4, 0, 0.001, 0.001, 0.004, [0])  # without drafts: not counted
    assert costs.costs == (VERIFY_COST, STEP_COST)
    drafting(costs, 2, 4, 4, 0.001, 0.001, 0.004, [1, 8])
    assert costs.measured


def test_drafting_steps_of_one_size_fall_back_to_the_constants_per_token() -> None:
    """Without spread in the steps' sizes b cannot be told from c: b is the
    constants' (VERIFY_COST of a row's share) and c what is left."""
    costs = DraftCosts()
    plain(costs, 40, 8, 0.002, 0.001)
    drafting(costs, 40, 8, 8, 0.002, 0.001, 0.003, [8])  # 8 rows, 1 draft token each
    report = costs.report()
    assert report["measured"] and not report["fitted"]
    assert report["b"] == pytest.approx(VERIFY_COST * 0.010 / 8)
    # 11 ms more than plain = c + 8 * b
    assert report["c"] == pytest.approx(0.011 - 8 * report["b"])
    assert costs.costs == pytest.approx((VERIFY_COST, report["c"] / 0.010))


def test_the_estimate_follows_a_change() -> None:
    costs = DraftCosts()
    plain(costs, 60, 4, 0.002, 0.001)
    drafting(costs, 100, 4, 4, 0.002, 0.001, 0.001, [1, 2, 4, 8])
    assert costs.costs == pytest.approx((4 * 0.001 / 0.006, 0.001 / 0.006))
    # Another machine's times: 3 ms a row or draft token and no fixed part
    # (a 12 ms plain step), and 6 ms of lost overlap.
    for _ in range(4 * PLAIN_WINDOW):
        plain(costs, 1, 4, 0.0, 0.003)
        drafting(costs, 4, 4, 4, 0.0, 0.003, 0.006, [1, 2, 4, 8])
    assert costs.report()["t_plain"] == pytest.approx(0.012, rel=0.05)
    assert costs.costs == pytest.approx((1.0, 0.5), rel=0.05)


def test_a_stall_moves_the_plain_average_a_bounded_amount() -> None:
    costs = DraftCosts()
    plain(costs, 3 * PLAIN_WINDOW, 4, 0.002, 0.001)
    drafting(costs, 40, 4, 4, 0.002, 0.001, 0.001, [1, 4])
    before = costs.report()["t_plain"]
    costs.observe(4, 0, 0, 1.0, False)  # a second lost inside one plain step
    after = costs.report()["t_plain"]
    assert after - before <= CLIP * before / PLAIN_WINDOW
    assert after > before


def test_wild_fits_are_clamped() -> None:
    costs = DraftCosts()
    plain(costs, 40, 4, 0.001, 0.001)
    # Bigger drafts ran faster (noise): b is 0, not negative.
    for count, seconds in ((1, 0.009), (8, 0.006)) * 20:
        costs.observe(4, count, 4, seconds, True)
    assert costs.report()["b"] == 0.0 and costs.costs[0] == 0.0
    # A drafting step costing a second: finite costs.
    costs = DraftCosts()
    plain(costs, 40, 4, 0.001, 0.001)
    for count, seconds in ((1, 1.0), (8, 60.0)) * 20:
        costs.observe(4, count, 1, seconds, True)
    verify, step = costs.costs
    assert verify <= MAX_VERIFY_COST and step <= MAX_STEP_COST


def test_an_engine_that_only_drafts_pauses_drafting_once_to_measure_plain_steps() -> None:
    costs = DraftCosts()
    assert not costs.pauses(1)
    drafting(costs, CALIBRATE_AFTER - 1, 4, 4, 0.001, 0.001, 0.004, [1, 8])
    drafting(costs, 10, 4, 0, 0.001, 0.001, 0.004, [0])  # no drafts: not counted
    assert not costs.pauses(50)
    drafting(costs, 1, 4, 4, 0.001, 0.001, 0.004, [8])
    # From the next step the scheduler asks about, PLAIN_PAUSE steps.
    assert [costs.pauses(clock) for clock in range(60, 60 + PLAIN_PAUSE + 2)] == \
        [True] * PLAIN_PAUSE + [False, False]
    # Measured plain steps: never again, however long it drafts.
    plain(costs, PLAIN_PAUSE - 1, 4, 0.001, 0.001)
    drafting(costs, 10 * CALIBRATE_AFTER, 4, 4, 0.001, 0.001, 0.004, [1, 8])
    assert not any(costs.pauses(clock) for clock in range(100, 200))
    assert costs.measured


def test_a_long_stretch_of_steps_without_overlap_counts_at_most_two_per_drafting_step() -> None:
    costs = DraftCosts()
    plain(costs, 40, 8, 0.002, 0.001)
    drafting(costs, 20, 8, 4, 0.002, 0.001, 0.003, [4, 8, 12, 16])
    for _ in range(500):  # nothing drafts, yet the loop keeps losing its overlap
        costs.observe(8, 0, 0, 0.010 + 0.002, True)
    assert costs.report()["tail"] == pytest.approx(2 * 0.002, rel=0.01)
