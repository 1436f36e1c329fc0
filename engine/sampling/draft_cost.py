"""What drafting costs on this engine, measured online (issue 16).

The draft-length controller (engine/sampling/draft_length.py) weighs the
tokens a draft promises against its cost in a row's share of a plain step:
verify_cost per draft token and step_cost per drafting step. Its constants
(0.2 and 0.1) were measured on the CPU at batch 1; on a GPU the cost
depends on the hardware, the model and the batch (on the H200, Qwen3-0.6B
at batch 32, a step whose rows each verify one draft token costs 1.5 plain
steps; at 8B batch 1 a draft token costs almost nothing:
docs/performance.md). DraftCosts (one per scheduler) measures them from the
loop's own step times, which EngineCore passes in (_observe_costs): for
each decode-only step, the time since the step before it (the loop's wall
time per step: completion to completion on a GPU), its rows, its draft
tokens, the rows that drafted and whether it lost the pipeline's overlap
(launched with nothing in flight: the loop completed the step before first,
as it does while a row may draft, and as the step after a verify step
always is).

- Plain steps (overlapped, no drafts): decayed averages of the interval and
  of the rows, over about PLAIN_WINDOW steps: T_plain at `rows_avg` rows.
- Drafting steps (with D > 0 draft tokens): a decayed least-squares line,
  over about DRAFTING_WINDOW steps, of the interval against x = rows + D.
  The model: such a step costs T_plain(rows) + c + b * D, with c the fixed
  cost of a drafting step (the overlap lost, a drafter's fixed work, the
  verification's) and b the time per draft token; a decode row is taken to
  cost what a verified position does (both are one more row through the
  same weights), so T_plain(rows) = T_avg + b * (rows - rows_avg) and the
  line's slope is b and its intercept T_avg - b * rows_avg + c. (Fitting
  against x, not D alone, keeps the adjustment of T_plain to a step's rows
  out of the fit's inputs, so no estimate feeds on itself.)
- Steps without overlap and without drafts (the step after a verify step,
  or one whose rows found nothing to propose) are neither: they cost the
  overlap alone, not what a drafting step does beyond it, and in the line
  they would bend its slope. (On the CPU, where no overlap is lost, such a
  step takes what a plain one does, 41-44 ms for SmolLM2-135M on two
  cores, while one with a single draft token takes about 25 ms more and
  one with four about 50 ms more.) Their time beyond a plain step's is
  drafting's all the same: a verify step is always followed by one, unless
  the rows draft again. So their excess (decayed sums, decaying with the
  drafting steps') is spread over the drafting steps, at most
  MAX_TAIL_STEPS of them to one, and added to c (on the H200 at the 0.6B
  shape one such step's excess is 0.4-0.6 ms, as much as c itself: a row
  drafting now and then paid it uncounted).
At the current batch of B rows (the last step's), n of which drafted in the
last step with drafts: verify_cost = b * B / T_plain(B) and step_cost =
c * B / (n * T_plain(B)), a row's share of a plain step being T_plain(B) / B
and c being shared by the rows that draft; step_shares = c * B / T_plain(B)
is all of c, what the scheduler's step gate weighs the step's drafts
against together (Scheduler._drafts_pay).

Until MIN_PLAIN_WEIGHT plain and MIN_DRAFTING_WEIGHT drafting steps are
measured (decayed counts), the costs are the constants. Where x has no
spread (every drafting step of the same size) b cannot be told from c: b is
then the constants' (VERIFY_COST rows' shares) and c the rest. Both costs
are clamped to a range where a wild fit stays finite.

An engine whose rows draft from their first step (a fresh engine's do)
never runs a plain step while any row may draft, so it would never measure
T_plain and keep the constants exactly where they may be wrong. So after
CALIBRATE_AFTER drafting steps with no plain measurement, the scheduler
leaves drafts out of PLAIN_PAUSE steps (`pauses`): the loop overlaps again
and the steps after the first are plain. Once plain steps are measured this
never happens again (the averages keep their last value when no plain
step runs).

Costs belong to the hardware, model and batch, not to the workload: unlike
the engine's acceptance (DraftAcceptance) they are kept whatever the
requests do. Per step the loop pays one observation (a few float
operations); the estimate is computed lazily, when a row asks.
"""

from __future__ import annotations

from typing import Any

from engine.sampling.draft_length import STEP_COST, VERIFY_COST

# Plain steps averaged: long enough to smooth a step's jitter, short enough
# to follow a change of batch within a few hundred tokens.
PLAIN_WINDOW = 32
# Drafting steps in the fit: twice as many, as its slope needs spread in the
# steps' sizes (drafts that shrink and grow, rows that come and go).
DRAFTING_WINDOW = 64
# Decayed counts measured before the costs are used: a GPU's plain steps
# are regular (a few percent apart), and the calibration pause gives five.
MIN_PLAIN_WEIGHT = 4.0
MIN_DRAFTING_WEIGHT = 8.0
# The least variance of x (tokens squared) that determines a slope: steps
# half a token apart on average.
MIN_SPREAD = 0.25
# Clamps, in a row's share of a plain step. A draft token costing more than
# 1 / MIN_GAIN shares never pays at any length, and a drafting step costing
# more shares than a row may draft tokens neither: beyond these the bound
# only keeps a wild fit finite. (An eager draft model's round, counted in b
# and c, took about 4 plain steps plus 1.2 a token at 8B batch 1:
# docs/performance.md.)
MAX_VERIFY_COST = 4.0
MAX_STEP_COST = 64.0
# An interval above CLIP times what a plain step of its size takes is cut
# to that: a stall inside a step (pages offloaded, a collection) moves the
# averages by a bounded amount, and a real change still shows, geometrically.
CLIP = 4.0
# Steps without overlap or drafts counted per drafting step, at most: one
# follows each verify step that the rows do not draft right after.
MAX_TAIL_STEPS = 2.0
# Drafting steps without any plain measurement before the scheduler pauses
# drafting to take one, and the steps that pause lasts (the first of them
# still runs without overlap: it follows a verify step).
CALIBRATE_AFTER = 32
PLAIN_PAUSE = 6


class DraftCosts:
    """The engine's measured draft costs (one per scheduler)."""

    __slots__ = ("_drafted", "_estimate", "_pause_wanted", "_paused_until", "_plain_rows",
                 "_plain_seconds", "_plain_weight", "_rows", "_stale", "_step_cost",
                 "_step_shares", "_sum_x", "_sum_xx", "_sum_xy", "_sum_y", "_tail_rows",
                 "_tail_steps", "_tail_y", "_unmeasured", "_verify_cost", "_weight")

    _PLAIN_DECAY = 1.0 - 1.0 / PLAIN_WINDOW
    _DRAFTING_DECAY = 1.0 - 1.0 / DRAFTING_WINDOW

    def __init__(self) -> None:
        self._plain_weight = self._plain_seconds = self._plain_rows = 0.0
        # Decayed sums of the drafting steps' fit: weight, x, x^2, y, x*y.
        self._weight = self._sum_x = self._sum_xx = self._sum_y = self._sum_xy = 0.0
        # Decayed sums of the steps without overlap or drafts: count, rows, seconds.
        self._tail_steps = self._tail_rows = self._tail_y = 0.0
        self._rows = 1  # the last decode-only step's
        self._drafted = 0  # rows that drafted in the last step with drafts (0: none yet)
        self._unmeasured = 0  # drafting steps since the last pause, with no plain measured
        self._pause_wanted = False
        self._paused_until = 0
        self._verify_cost, self._step_cost = VERIFY_COST, STEP_COST
        self._step_shares = STEP_COST
        self._estimate: dict[str, Any] = {}
        self._stale = False

    # ---- measuring ----------------------------------------------------------

    def observe(self, rows: int, drafts: int, drafted: int, seconds: float,
                synchronous: bool) -> None:
        """One decode-only step of `rows` rows carrying `drafts` draft tokens
        in `drafted` rows, `seconds` of the loop's time since the step before
        it; `synchronous`: launched with no step in flight (no overlap)."""
        self._rows = rows
        x = rows + drafts
        plain_weight = self._plain_weight
        if plain_weight >= MIN_PLAIN_WEIGHT:
            rows_avg = self._plain_rows / plain_weight
            ceiling = CLIP * self._plain_seconds / plain_weight * max(1.0, x / rows_avg)
            if seconds > ceiling:
                seconds = ceiling
        self._stale = True
        if not drafts:
            if not synchronous:
                decay = self._PLAIN_DECAY
                self._plain_weight = decay * plain_weight + 1.0
                self._plain_seconds = decay * self._plain_seconds + seconds
                self._plain_rows = decay * self._plain_rows + rows
            else:
                self._tail_steps += 1.0
                self._tail_rows += rows
                self._tail_y += seconds
            return
        self._drafted = drafted
        decay = self._DRAFTING_DECAY
        self._tail_steps *= decay
        self._tail_rows *= decay
        self._tail_y *= decay
        self._weight = decay * self._weight + 1.0
        self._sum_x = decay * self._sum_x + x
        self._sum_xx = decay * self._sum_xx + x * x
        self._sum_y = decay * self._sum_y + seconds
        self._sum_xy = decay * self._sum_xy + x * seconds
        if plain_weight < MIN_PLAIN_WEIGHT:
            self._unmeasured += 1
            if self._unmeasured >= CALIBRATE_AFTER:
                self._unmeasured = 0
                self._pause_wanted = True

    def pauses(self, clock: int) -> bool:
        """Whether the step the scheduler's clock calls `clock` goes without
        drafts, so that plain steps can be measured (see the module's
        docstring). The first call after the pause is wanted starts it."""
        if self._pause_wanted:
            self._pause_wanted = False
            self._paused_until = clock + PLAIN_PAUSE
        return clock < self._paused_until

    # ---- the estimate -------------------------------------------------------

    @property
    def costs(self) -> tuple[float, float]:
        """(verify_cost, step_cost) in a row's share of a plain step."""
        if self._stale:
            self._update()
        return self._verify_cost, self._step_cost

    @property
    def step_shares(self) -> float:
        """A drafting step's fixed cost, all of it, in a row's share of a
        plain step: what the rows that draft in one step share."""
        if self._stale:
            self._update()
        return self._step_shares

    @property
    def measured(self) -> bool:
        """Whether the costs come from measurements (not the constants)."""
        return (self._plain_weight >= MIN_PLAIN_WEIGHT
                and self._weight >= MIN_DRAFTING_WEIGHT)

    def report(self) -> dict[str, Any]:
        """The costs and what they come from, for benchmarks: verify_cost,
        step_cost, step_shares, b and c (seconds; c with tail, the share of
        the steps without overlap or drafts), t_plain (seconds at `rows`
        rows), rows, drafted, measured, fitted (b from the fit, not the
        constants)."""
        costs = self.costs
        return {"verify_cost": costs[0], "step_cost": costs[1],
                "step_shares": self._step_shares, "rows": self._rows,
                "drafted": self._drafted, "measured": self.measured, **self._estimate}

    def _update(self) -> None:
        self._stale = False
        if not self.measured:
            self._verify_cost, self._step_cost = VERIFY_COST, STEP_COST
            self._step_shares = STEP_COST
            self._estimate = {}
            return
        t_avg = self._plain_seconds / self._plain_weight
        rows_avg = self._plain_rows / self._plain_weight
        share = t_avg / rows_avg  # a row's share of a plain step
        weight = self._weight
        mean_x, mean_y = self._sum_x / weight, self._sum_y / weight
        spread = self._sum_xx / weight - mean_x * mean_x
        fitted = spread >= MIN_SPREAD
        if fitted:
            b = (self._sum_xy / weight - mean_x * mean_y) / spread
            b = min(max(b, 0.0), MAX_VERIFY_COST * share)
        else:
            b = VERIFY_COST * share
        c = max(mean_y - t_avg - b * (mean_x - rows_avg), 0.0)
        # The steps without overlap or drafts: their mean time beyond a
        # plain step of their rows, times how many there are per drafting
        # step (at most MAX_TAIL_STEPS: their sums decay only with drafting
        # steps, so a long stretch without any must not grow them unbounded).
        tail = 0.0
        if self._tail_steps > 0.0:
            excess = (self._tail_y - self._tail_steps * (t_avg - b * rows_avg)
                      - b * self._tail_rows) / self._tail_steps
            tail = max(excess, 0.0) * min(self._tail_steps / weight, MAX_TAIL_STEPS)
        c += tail
        rows = self._rows
        # Fewer rows than measured cost no less per row (a step's fixed part).
        t_plain = max(t_avg + b * (rows - rows_avg), share * min(rows, rows_avg))
        drafted = min(self._drafted or rows, rows)
        self._verify_cost = min(b * rows / t_plain, MAX_VERIFY_COST)
        self._step_cost = min(c * rows / (drafted * t_plain), MAX_STEP_COST)
        self._step_shares = min(c * rows / t_plain, MAX_STEP_COST)
        self._estimate = {"b": b, "c": c, "tail": tail, "t_plain": t_plain, "fitted": fitted}
