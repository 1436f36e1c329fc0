"""How many tokens one row drafts next (issue 16's adaptive speculation).

A verify step that carries k draft tokens costs more than a plain decode
step and pays only in the drafts it keeps. The cost, in plain steps:
- VERIFY_COST per draft token: the target computes k more positions;
- STEP_COST per drafting step: the drafter's lookup, and on a GPU the
  loop's lost overlap (it completes the step in flight before it schedules
  while any row may draft, engine/scheduling/core.py) and no CUDA graph.
So a row with per-position acceptance p (draft token i is kept with
probability p^i: every token before it must be kept too) expects
(1 + p + ... + p^k) tokens for 1 + STEP_COST + k * VERIFY_COST steps. Each
row keeps p as a decaying average of its own verified positions and drafts
the k in 1..K that maximises that ratio; when no k is MIN_GAIN better than
not drafting at all, the row stops drafting and probes again, with a
single draft token, after a back-off of plain steps that doubles at each
failed probe (up to a cap), so that a row whose text starts copying later
resumes, and one that never copies costs almost nothing.

A row starts as if its drafts had all been accepted (p = 1, the full K): a
drafter that is right drafts the full length from its first step, and one
that is wrong falls to a single token and then off within a few steps (six
with K = 8: about five plain steps' worth of work, once per request).
A drafter that proposes nothing (no n-gram match) has still cost a step
without overlap: it counts as a rejected position, so a row that never
finds a match backs off like one whose matches are wrong.
"""

from __future__ import annotations

# Measured on the CPU path (docs/performance.md, SmolLM2-135M, two cores):
# a plain step takes 31-35 ms and every verified draft token adds 6-7 ms.
# On a GPU at small batches a position costs much less (the weights are read
# once for all of them), so there this overestimates the cost: drafts come
# out shorter than they could, never dearer than they pay.
VERIFY_COST = 0.2
# The fixed part, a hedge: nothing measurable on the CPU (the n-gram lookup
# is tens of microseconds); on a GPU the lost host/device overlap, which
# grows with the host's share of a step.
STEP_COST = 0.1
# Draft only where the expected gain is at least this: p is an estimate from
# a handful of positions, and the worst case should cost at most about 5%.
MIN_GAIN = 1.05
# p averages about the last 1 / (1 - DECAY) = 10 verified positions, so
# that a miss or two inside a copy only shortens the draft. (Replaying the
# CPU benchmark's outputs through the n-gram drafter, a 5-position window
# lost a tenth of the copy tasks' gain to needless switch-offs.)
DECAY = 0.9
# What a new row's starting assumption (p = 1) and a probe's are worth, in
# positions: fewer than the window, so that a drafter that is wrong from
# the start falls to off within five or six steps.
PRIOR_WEIGHT = 4.0
# After switching off: plain steps before the first probe, doubling at each
# probe that fails, up to the cap. A failed probe costs one drafting step of
# one token (STEP_COST + VERIFY_COST = 0.3 steps; on a GPU, two steps of the
# whole batch without overlap), so at the cap the overhead is a fraction of
# a percent; the first wait is short because a copy often starts a few
# tokens into an answer ("Here is the file: ...").
FIRST_BACKOFF = 16
MAX_BACKOFF = 128
# What a probe assumes: above the one-token threshold (0.365 with the costs
# above), so that a kept probe lifts the row to two tokens (p = 0.53) and a
# missed one turns it off again (p = 0.31).
PROBE_ACCEPTANCE = 0.4


class DraftLength:
    """One row's next draft length, from the acceptance of its recent drafts."""

    __slots__ = ("_accepted", "_backoff", "_positions", "length", "max_tokens", "resume_at",
                 "switch_offs")

    def __init__(self, max_tokens: int) -> None:
        assert max_tokens > 0
        self.max_tokens = max_tokens
        # Decayed counts of verified positions and of those accepted: p is
        # their ratio. Acceptances to start (p = 1).
        self._positions = self._accepted = PRIOR_WEIGHT
        self.length = max_tokens  # 0 while switched off
        self.resume_at = 0  # the clock's step from which a switched-off row probes
        self._backoff = FIRST_BACKOFF
        self.switch_offs = 0

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is kept, given the one before it was."""
        return self._accepted / self._positions

    def allows(self, now: int) -> bool:
        """Whether the row drafts in the step the scheduler's clock calls now."""
        return self.length > 0 or now >= self.resume_at

    def limit(self, now: int) -> int:
        """How many tokens the row may draft now (0: decode as usual)."""
        if self.length == 0 and now >= self.resume_at:
            # Probe with a single token.
            self._positions = PRIOR_WEIGHT
            self._accepted = PROBE_ACCEPTANCE * PRIOR_WEIGHT
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
        self.length = best_length(self.acceptance, self.max_tokens)
        if self.length == 0:
            # On the scheduler's clock, rounded up to a multiple of the
            # back-off (16 times a power of two): switched-off rows probe in
            # the same steps, so a batch loses its overlap for a probe
            # together, not once per row.
            backoff = self._backoff
            self.resume_at = -(-(now + backoff) // backoff) * backoff
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
            self.switch_offs += 1

    def _observe(self, kept: float) -> None:
        self._positions = DECAY * self._positions + 1.0
        self._accepted = DECAY * self._accepted + kept


def best_length(acceptance: float, max_tokens: int) -> int:
    """The draft length in 1..max_tokens with the most tokens per step's cost
    at this per-position acceptance, or 0 when none gains more than MIN_GAIN."""
    best, best_gain, last_gain = 0, MIN_GAIN, 0.0
    expected, kept = 1.0, 1.0  # tokens per step with k drafts; p^k
    for k in range(1, max_tokens + 1):
        kept *= acceptance
        expected += kept
        gain = expected / (1.0 + STEP_COST + k * VERIFY_COST)
        if gain < last_gain:
            # Past its peak: the gain only falls from here (the expected
            # tokens grow ever less per draft token, the cost as much).
            break
        if gain > best_gain:
            best, best_gain = k, gain
        last_gain = gain
    return best
