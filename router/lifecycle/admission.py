"""Lanes: how many of a model's requests run in its engine at once.

A request that holds its model (a lease) still has to get a lane: at most the
engine's max_concurrency leases run, the rest wait here in arrival order. The
wait is bounded twice: at most --max-pending-requests may wait (the next gets
429 server_overloaded at once), and none waits past --pending-timeout-ms from
its arrival (503 request_queue_timeout). A client that leaves gives up its
place. Nothing here is unbounded.

Each engine gets a queue of its own (a new one at every load): when the
engine dies or the server shuts down the queue is closed, and every request
still waiting for a lane gets LanesClosed at once instead of a lane on an
engine that is gone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from router.errors import Overloaded, QueueTimeout


class LanesClosed(Exception):
    """The engine these lanes belong to is gone (or the server is stopping);
    the waiting request was never submitted."""

    def __init__(self, reason: str, code: str = "engine_failed"):
        super().__init__(reason)
        self.reason = reason
        self.code = code


@dataclass(eq=False)
class _Waiter:
    granted: asyncio.Future[None]
    since: float


class LaneQueue:
    def __init__(self) -> None:
        self.active = 0
        self.peak_active = 0
        self._waiters: deque[_Waiter] = deque()
        self._closed: tuple[str, str] | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def waits(self, limit: int) -> list[float]:
        """Seconds the first `limit` waiters have waited, oldest first."""
        now = time.monotonic()
        return [now - waiter.since for waiter in list(self._waiters)[:limit]]

    def close(self, reason: str, code: str = "engine_failed") -> None:
        """No lane will be granted any more: waiters get LanesClosed now,
        later arrivals at once. Requests holding a lane still leave()."""
        self._closed = (reason, code)
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.granted.done():
                waiter.granted.set_exception(LanesClosed(reason, code))

    async def enter(self, lanes: int, max_pending: int, deadline: float) -> None:
        if self._closed is not None:
            raise LanesClosed(*self._closed)
        if self.active < lanes and not self._waiters:
            self._take()
            return
        if len(self._waiters) >= max_pending:
            raise Overloaded(f"the model's {lanes} lanes are busy and {len(self._waiters)} "
                             "requests already wait; try again shortly", code="server_overloaded",
                             retry_after=1)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), time.monotonic())
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), max(deadline - time.monotonic(), 0))
        except BaseException as exc:
            granted = waiter.granted
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif granted.done() and not granted.cancelled() and granted.exception() is None:
                # The lane was handed over in the same moment this request
                # timed out or its client left: pass it on.
                self.leave(lanes)
            if isinstance(exc, TimeoutError):
                raise QueueTimeout("the request waited too long for a free lane "
                                   "(--pending-timeout-ms)", code="request_queue_timeout",
                                   retry_after=1) from None
            raise

    def leave(self, lanes: int) -> None:
        self.active -= 1
        while self._waiters and self.active < lanes and self._closed is None:
            waiter = self._waiters.popleft()
            if not waiter.granted.done():
                self._take()
                waiter.granted.set_result(None)

    def _take(self) -> None:
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
