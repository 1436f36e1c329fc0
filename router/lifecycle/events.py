"""The event stream behind GET /models/sse.

Every watcher gets its own bounded queue; a watcher that falls that far behind
is dropped (its stream ends) rather than holding memory for everyone else.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

# Events a slow watcher may have pending before it is dropped.
WATCHER_BACKLOG = 1024


class Subscription:
    def __init__(self, events: ModelEvents):
        self._events = events
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(WATCHER_BACKLOG)

    async def next(self, wait_seconds: float) -> dict[str, Any] | None:
        """The next event; None on timeout. Raises EOFError once dropped."""
        try:
            event = await asyncio.wait_for(self.queue.get(), wait_seconds)
        except TimeoutError:
            return None
        if event is None:
            raise EOFError
        return event

    def close(self) -> None:
        self._events._watchers.discard(self)


class ModelEvents:
    def __init__(self) -> None:
        self._watchers: set[Subscription] = set()

    def subscribe(self) -> Subscription:
        subscription = Subscription(self)
        self._watchers.add(subscription)
        return subscription

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def publish(self, model: str, event: str, data: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"model": model, "event": event}
        if data is not None:
            message["data"] = data
        for watcher in list(self._watchers):
            try:
                watcher.queue.put_nowait(message)
            except asyncio.QueueFull:
                log.warning("dropping a /models/sse watcher %d events behind", WATCHER_BACKLOG)
                self._watchers.discard(watcher)
                watcher.queue.get_nowait()
                watcher.queue.put_nowait(None)

    def close(self) -> None:
        """End every stream (server shutdown)."""
        for watcher in list(self._watchers):
            while True:
                try:
                    watcher.queue.put_nowait(None)
                    break
                except asyncio.QueueFull:
                    watcher.queue.get_nowait()
        self._watchers.clear()
