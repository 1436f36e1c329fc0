"""The loop's time per decode step, for the draft costs (issue 16).

EngineCore tells StepTimes when step() is entered and left, when a step is
launched and when one completes; StepTimes passes each decode-only step's
interval since the step before it, with its rows, draft tokens, drafting
rows and whether it ran without overlap, to the scheduler's DraftCosts
(engine/sampling/draft_cost.py).

The interval is the loop's wall time per step. On a GPU the device runs a
step behind the host and its tokens are ready when the host has waited for
them: the interval runs from one completion to the next, so for an
overlapped step it is the device's time and for one without overlap the
host's time before its launch as well. On the CPU a step is computed as it
is launched, before the step ahead of it is completed: there the interval
runs from the return of one step's sampling to the next's.

Left out: steps with prompt tokens and the step after one (its interval is
the prompt step's tail), and any whose interval holds more than
STALL_SECONDS of the loop's time outside step(): it waited idle for
commands or handled one that took long (a grammar compiled, a slot saved).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.scheduling.core import InFlight
    from engine.scheduling.scheduler import Scheduler

# Between busy turns the loop spends a few microseconds outside step(); a
# millisecond is far above that and below any idle wait worth the name
# (the loop blocks up to a second waiting for commands).
STALL_SECONDS = 0.001


class StepTimes:
    """Times decode-only steps for the scheduler's draft costs."""

    __slots__ = ("_after_prompt", "_asynchronous", "_last_ready_at", "_left_at", "_outside",
                 "_scheduler")

    def __init__(self, scheduler: Scheduler, asynchronous: bool) -> None:
        """asynchronous: the device runs steps behind the host (CUDA)."""
        self._scheduler = scheduler
        self._asynchronous = asynchronous
        self._last_ready_at = 0.0
        # The loop's time outside step() since the last step's tokens were
        # ready; when step() last returned (0: never, so the first interval
        # counts as idle); whether the last completed step had prompt tokens.
        self._outside = 0.0
        self._left_at = 0.0
        self._after_prompt = True

    def enter(self) -> None:
        self._outside += time.perf_counter() - self._left_at

    def leave(self) -> None:
        self._left_at = time.perf_counter()

    def launched(self, flight: InFlight) -> None:
        """A step launched, its sampling returned: off a CUDA device its
        tokens are ready now."""
        if not self._asynchronous:
            flight.ready_at = time.perf_counter()
            flight.outside, self._outside = self._outside, 0.0

    def completed(self, flight: InFlight, now: float) -> None:
        """A step's tokens taken by the host at `now`."""
        if self._asynchronous:
            ready, outside = now, self._outside
            self._outside = 0.0
        else:
            ready, outside = flight.ready_at, flight.outside
        interval, self._last_ready_at = ready - self._last_ready_at, ready
        after_prompt, self._after_prompt = self._after_prompt, flight.prefill_tokens > 0
        if after_prompt or flight.prefill_tokens or outside > STALL_SECONDS:
            return
        chunks = flight.out.chunks
        rows = len(chunks)  # a decode-only step's chunks are all decode rows
        drafts = flight.decode_tokens - rows
        drafted = sum(1 for chunk in chunks if chunk.draft) if drafts else 0
        self._scheduler.draft_costs.observe(rows, drafts, drafted, interval, flight.synchronous)
