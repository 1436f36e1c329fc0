"""Draft costs fixed for tests (engine/sampling/draft_cost.py measures them
from the loop's step times): a test's step times are its machine's, and on a
loaded two-core CI machine a real model's measured costs could switch its
drafting off, so tests that check what drafting computes weigh drafts with
given costs. DraftCosts's own tests (tests/engine/test_draft_cost.py,
tests/engine/test_adaptive_speculation.py) measure."""

from __future__ import annotations

from engine.sampling.draft_cost import DraftCosts
from engine.sampling.draft_length import STEP_COST, VERIFY_COST


class FixedCosts(DraftCosts):
    """Draft costs that measure nothing: the fake device's step times are
    the host's bookkeeping alone, so tests over it weigh drafts with given
    costs (by default the constants), never with its timings."""

    __slots__ = ("_fixed",)

    def __init__(self, verify_cost: float = VERIFY_COST, step_cost: float = STEP_COST) -> None:
        super().__init__()
        self._fixed = (verify_cost, step_cost)

    def observe(self, rows: int, drafts: int, drafted: int, seconds: float,
                synchronous: bool) -> None:
        pass

    @property
    def costs(self) -> tuple[float, float]:
        return self._fixed

    @property
    def step_shares(self) -> float:
        return self._fixed[1]
