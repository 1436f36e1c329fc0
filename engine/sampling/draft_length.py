"""How many tokens one row drafts next (issue 16's adaptive speculation).

A verify step that carries k draft tokens costs more than a plain decode
step and pays only in the drafts it keeps. The cost, in a row's share of a
plain step:
- verify_cost per draft token: the target computes k more positions;
- step_cost per drafting step: the drafter's lookup, and on a GPU the
  loop's lost overlap (it completes the step in flight before it schedules
  while any row may draft, engine/scheduling/core.py).
Both are measured online from the loop's step times (DraftCosts, one per
scheduler: engine/sampling/draft_cost.py), since they depend on the
hardware, the model and the batch; until enough steps are measured they are
the constants VERIFY_COST and STEP_COST, measured on the CPU at batch 1.
So a row with per-position acceptance p (draft token i is kept with
probability p^i: every token before it must be kept too) expects
(1 + p + ... + p^k) tokens for 1 + step_cost + k * verify_cost shares. Each
row keeps p as a decaying average of its own verified positions and drafts
the k in 1..K that maximises that ratio (best_length, with the engine's
costs of the moment); when no k is MIN_GAIN better than not drafting at
all, the row stops drafting and probes again, with a single draft token,
after a back-off of plain steps that doubles at each failed probe (up to a
cap), so that a row whose text starts copying later resumes, and one that
never copies costs almost nothing. A probe assumes an acceptance a little
above the least at which best_length drafts with the current costs
(probe_acceptance), so that a kept probe lifts the row to drafting and a
missed one turns it off again. (The figures below are the constants'.)

A new row starts from the engine's acceptance (DraftAcceptance, one per
scheduler: the same decaying average over every row's verified positions,
with a window of ENGINE_WINDOW positions), weighted as PRIOR_WEIGHT
positions. A fresh engine's is 1, so a row drafts the full K from its first
step; where the engine's drafts have been kept lately, so does a new row,
and one whose drafter turns out wrong falls to a single token and then off
within a few steps (six with K = 8: about five plain steps' worth of work).
Where they have not been kept, the row starts switched off and probes at
the next multiple of FIRST_BACKOFF on the scheduler's clock, where other
new rows probe too: on a GPU each drafting step costs the whole batch its
host/device overlap, so requests arriving one after another into a batch
that does not copy no longer cost it their start-up each. The price: a
request that copies, arriving while the engine's drafts are rejected,
waits up to FIRST_BACKOFF steps for its first (one-token) probe and then
climbs as any probing row does, instead of drafting K from its first step.
The window is short so that a change of workload shows within a few
requests (128 tokens each, one after another): after requests whose drafts
all miss, a copying request's first few drafting steps lift the estimate
over the one-token threshold (about 7 kept positions from none), and the
next request drafts from its first step; after a stretch of copying, of
requests whose drafts all miss the first starts at K (and rejects about
nine positions, probes included), the next two at what the falling
estimate gives (with K = 8: 2 and 1 tokens) and the fourth starts switched
off (about ENGINE_WINDOW rejected positions in all).
A drafter that proposes nothing (no n-gram match) has still cost a step
without overlap: it counts as a rejected position (for the engine too), so
a row that never finds a match backs off like one whose matches are wrong.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling.draft_cost import DraftCosts

# The costs until the engine has measured its own (DraftCosts), and those
# of a row made without it. Measured on the CPU path (docs/performance.md,
# SmolLM2-135M, two cores, batch 1): a plain step takes 31-35 ms and every
# verified draft token adds 6-7 ms. On the H200 they are wrong both ways: at
# batch 1 a position costs much less (the weights are read once for all of
# them), at the 0.6B shape and batch 32 about 0.5 of a row's share.
VERIFY_COST = 0.2
# The fixed part, a hedge: on a GPU the lost host/device overlap, which
# grows with the host's share of a step. (Measured online on the same CPU
# on 2026-12-02 it came out larger, about 0.6 of a plain step: a step with
# one draft token took 25 ms more than a 43 ms plain one, the first extra
# row through the float32 matmuls costing more than the ones after it.)
STEP_COST = 0.1
# Draft only where the expected gain is at least this: p is an estimate from
# a handful of positions, and the worst case should cost at most about 5%.
MIN_GAIN = 1.05
# p averages about the last 1 / (1 - DECAY) = 10 verified positions, so
# that a miss or two inside a copy only shortens the draft. (Replaying the
# CPU benchmark's outputs through the n-gram drafter, a 5-position window
# lost a tenth of the copy tasks' gain to needless switch-offs.)
DECAY = 0.9
# What a new row's starting assumption (the engine's acceptance, 1 on a
# fresh engine) and a probe's are worth, in positions: fewer than the
# window, so that a drafter that is wrong from the start falls to off
# within five or six steps.
PRIOR_WEIGHT = 4.0
# After switching off: plain steps before the first probe, doubling at each
# probe that fails, up to the cap. A failed probe costs one drafting step of
# one token (STEP_COST + VERIFY_COST = 0.3 steps; on a GPU, two steps of the
# whole batch without overlap), so at the cap the overhead is a fraction of
# a percent; the first wait is short because a copy often starts a few
# tokens into an answer ("Here is the file: ...").
FIRST_BACKOFF = 16
MAX_BACKOFF = 128
# What a probe assumes: this much above the least acceptance at which
# best_length drafts with the current costs (0.365 with the constants:
# 0.40), so that a kept probe lifts the row to drafting (with the
# constants, two tokens at p = 0.53) and a missed one turns it off again
# (p = 0.31). After a probe, p is (0.9 * 4 * q + 1) / 4.6 if it was kept
# and 0.78 * q if not (DECAY, PRIOR_WEIGHT): above the threshold for any
# threshold up to 1, and below it for any margin under 1.28.
PROBE_MARGIN = 1.1
# The engine's estimate averages about the last ENGINE_WINDOW verified
# positions of all rows: short enough to follow a change of workload within
# a few requests (see above), long enough that one request's stray kept
# draft does not turn new rows on.
ENGINE_WINDOW = 16


class DraftAcceptance:
    """The engine's per-position acceptance over every row's verified
    positions: where a new row's estimate starts (one per scheduler)."""

    __slots__ = ("_accepted", "_positions")

    _DECAY = 1.0 - 1.0 / ENGINE_WINDOW

    def __init__(self) -> None:
        # A full window of acceptances: a fresh engine's rows start at p = 1,
        # as if it had been copying.
        self._positions = self._accepted = float(ENGINE_WINDOW)

    @property
    def acceptance(self) -> float:
        return self._accepted / self._positions

    def observe(self, kept: float) -> None:
        self._positions = self._DECAY * self._positions + 1.0
        self._accepted = self._DECAY * self._accepted + kept


class DraftLength:
    """One row's next draft length, from the acceptance of its recent drafts."""

    __slots__ = ("_accepted", "_backoff", "_costs", "_engine", "_positions", "length",
                 "max_tokens", "resume_at", "switch_offs")

    def __init__(self, max_tokens: int, engine: DraftAcceptance | None = None,
                 now: int = 0, costs: DraftCosts | None = None) -> None:
        """A row that may draft max_tokens, starting from the engine's
        acceptance (None: p = 1) in the step the scheduler's clock calls now,
        its lengths weighed with the engine's measured costs (None: the
        constants)."""
        assert max_tokens > 0
        self.max_tokens = max_tokens
        self._engine = engine
        self._costs = costs
        start = 1.0 if engine is None else engine.acceptance
        # Decayed counts of verified positions and of those accepted: p is
        # their ratio.
        self._positions = PRIOR_WEIGHT
        self._accepted = start * PRIOR_WEIGHT
        self.length = best_length(start, max_tokens, *self._current_costs())  # 0: off
        self.resume_at = 0  # the clock's step from which a switched-off row probes
        self._backoff = FIRST_BACKOFF
        self.switch_offs = 0
        if self.length == 0:
            # The engine's drafts are not kept: start off, as if the first
            # back-off were under way, and probe at the next multiple of it,
            # with the other rows that start off meanwhile.
            self.resume_at = (now // FIRST_BACKOFF + 1) * FIRST_BACKOFF
            self._backoff = 2 * FIRST_BACKOFF

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is kept, given the one before it was."""
        return self._accepted / self._positions

    def allows(self, now: int) -> bool:
        """Whether the row drafts in the step the scheduler's clock calls now."""
        return self.length > 0 or now >= self.resume_at

    def probes(self, now: int) -> bool:
        """Whether the row's draft in that step would be a probe (switched
        off, its back-off over): a probe's worth is what it tells, not the
        tokens it is expected to keep."""
        return self.length == 0 and now >= self.resume_at

    def limit(self, now: int) -> int:
        """How many tokens the row may draft now (0: decode as usual)."""
        if self.length == 0 and now >= self.resume_at:
            # Probe with a single token.
            self._positions = PRIOR_WEIGHT
            self._accepted = probe_acceptance(self.max_tokens,
                                              *self._current_costs()) * PRIOR_WEIGHT
            self.length = 1
        return self.length

    def record(self, proposed: int, accepted: int, now: int) -> None:
        """A drafting step's outcome: `proposed` draft tokens (0: the drafter
        found none), the first `accepted` of them kept, in the step the
        scheduler's clock calls now (it counts the steps that decode: one
        more for every row at once, Scheduler.clock)."""
        assert 0 <= accepted <= proposed
        for _ in range(accepted):
            self._observe(1.0)
        if accepted < proposed or proposed == 0:
            self._observe(0.0)
        if proposed and accepted == proposed:
            # Every draft kept: the row copies; a later switch-off waits little.
            self._backoff = FIRST_BACKOFF
        self.length = best_length(self.acceptance, self.max_tokens, *self._current_costs())
        if self.length == 0:
            self.switch_off(now)

    def switch_off(self, now: int) -> None:
        """Stop drafting until the back-off from the step the clock calls
        now is over; then probe. (Also the scheduler's step gate's answer
        to drafts that do not pay for their step together.) On the clock,
        rounded up to a multiple of the back-off (16 times a power of two):
        switched-off rows probe in the same steps, so a batch loses its
        overlap for a probe together, not once per row."""
        self.length = 0
        backoff = self._backoff
        self.resume_at = -(-(now + backoff) // backoff) * backoff
        self._backoff = min(2 * self._backoff, MAX_BACKOFF)
        self.switch_offs += 1

    def _current_costs(self) -> tuple[float, float]:
        """(verify_cost, step_cost): the engine's measured ones, or the constants."""
        return (VERIFY_COST, STEP_COST) if self._costs is None else self._costs.costs

    def _observe(self, kept: float) -> None:
        self._positions = DECAY * self._positions + 1.0
        self._accepted = DECAY * self._accepted + kept
        if self._engine is not None:
            self._engine.observe(kept)


def best_length(acceptance: float, max_tokens: int, verify_cost: float = VERIFY_COST,
                step_cost: float = STEP_COST) -> int:
    """The draft length in 1..max_tokens with the most tokens per step's cost
    at this per-position acceptance, or 0 when none gains more than MIN_GAIN;
    the costs in a row's share of a plain step (the module's docstring)."""
    best, best_gain, last_gain = 0, MIN_GAIN, 0.0
    expected, kept = 1.0, 1.0  # tokens per step with k drafts; p^k
    fixed = 1.0 + step_cost
    for k in range(1, max_tokens + 1):
        kept *= acceptance
        expected += kept
        gain = expected / (fixed + k * verify_cost)
        if gain < last_gain:
            # Past its peak: the gain only falls from here (the expected
            # tokens grow ever less per draft token, the cost as much).
            break
        if gain > best_gain:
            best, best_gain = k, gain
        last_gain = gain
    return best


def expected_kept(acceptance: float, tokens: int) -> float:
    """The draft tokens expected to be kept of `tokens` at this per-position
    acceptance: p + p^2 + ... + p^tokens."""
    if acceptance >= 1.0:
        return float(tokens)
    return acceptance * (1.0 - acceptance**tokens) / (1.0 - acceptance)


def draft_threshold(max_tokens: int, verify_cost: float = VERIFY_COST,
                    step_cost: float = STEP_COST) -> float:
    """The least per-position acceptance at which best_length drafts with
    these costs, within 2^-12 above (1.0 where not even p = 1 pays). With
    a large step_cost it is a longer draft that pays first, not one token,
    so it is searched, not solved for k = 1. (best_length drafts at p iff
    some k's gain exceeds MIN_GAIN; each gain grows with p, so that holds
    above a threshold.)"""
    if best_length(1.0, max_tokens, verify_cost, step_cost) == 0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(12):
        middle = 0.5 * (low + high)
        if best_length(middle, max_tokens, verify_cost, step_cost):
            high = middle
        else:
            low = middle
    return high


# Cached: the rows that probe together in a step ask with the same costs,
# and a search is a dozen best_length calls.
@lru_cache(maxsize=32)
def probe_acceptance(max_tokens: int, verify_cost: float = VERIFY_COST,
                     step_cost: float = STEP_COST) -> float:
    """The acceptance a probing row assumes (PROBE_MARGIN above the threshold)."""
    return min(1.0, PROBE_MARGIN * draft_threshold(max_tokens, verify_cost, step_cost))
