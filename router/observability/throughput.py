"""Tokens per second per loaded model, from the counters each engine
publishes with every step (EngineClient.stats), and the periodic task that
hands them to the log line and the request log."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from router.lifecycle.slot import ModelSlot, ModelState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelThroughput:
    """One model over one interval."""

    model: str
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    running: int
    prefilling: int
    waiting: int
    # Requests the router holds back until a lane frees (--max-concurrency);
    # the engine's `waiting` are those it has but cannot fit yet.
    queued: int
    kv_pages_used: int
    kv_pages_total: int

    def per_second(self, count: int) -> float:
        return count / self.seconds if self.seconds > 0 else 0.0

    @property
    def busy(self) -> bool:
        return bool(self.prompt_tokens or self.generated_tokens or self.running or self.waiting
                    or self.queued)

    def as_event(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens_per_second": round(self.per_second(self.prompt_tokens), 3),
            "cached_tokens_per_second": round(self.per_second(self.cached_tokens), 3),
            "generated_tokens_per_second": round(self.per_second(self.generated_tokens), 3),
            "running": self.running,
            "prefilling": self.prefilling,
            "waiting": self.waiting,
            "queued": self.queued,
            "kv_pages_used": self.kv_pages_used,
            "kv_pages_total": self.kv_pages_total,
        }


@dataclass(frozen=True)
class _Seen:
    engine: object  # the engine whose counters these were; a new engine starts at 0
    at: float
    prompt: int
    cached: int
    generated: int


class ThroughputMeter:
    """Differences of the engines' counters between two samples."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self._last = clock()

    def sample(self, slots: Iterable[ModelSlot]) -> list[ModelThroughput]:
        """One entry per loaded model (a sleeping one has nothing to say)."""
        now = self._clock()
        found: list[ModelThroughput] = []
        seen: dict[str, _Seen] = {}
        for slot in slots:
            engine = slot.engine
            if slot.state is not ModelState.LOADED or engine is None:
                continue
            stats = engine.client.stats
            current = _Seen(engine, now, stats.prompt_tokens_total, stats.cached_tokens_total,
                            stats.generated_tokens_total)
            before = self._seen.get(slot.id)
            if before is None or before.engine is not engine:
                # A model loaded during the interval: its engine counted from 0.
                before = _Seen(engine, self._last if before is None else before.at, 0, 0, 0)
            seen[slot.id] = current
            found.append(ModelThroughput(
                model=slot.id, seconds=now - before.at,
                prompt_tokens=max(current.prompt - before.prompt, 0),
                cached_tokens=max(current.cached - before.cached, 0),
                generated_tokens=max(current.generated - before.generated, 0),
                running=stats.running, prefilling=stats.prefilling, waiting=stats.waiting,
                queued=slot.lanes.waiting,
                kv_pages_used=stats.kv_pages_used, kv_pages_total=stats.kv_pages_total,
            ))
        self._seen = seen
        self._last = now
        return found


async def report_throughput(slots: Callable[[], Iterable[ModelSlot]], interval: float,
                            sinks: list[Callable[[list[ModelThroughput]], None]]) -> None:
    """Every `interval` seconds, while any model is loaded, hand each sink the
    models' throughput since the last time (runs until cancelled)."""
    meter = ThroughputMeter()
    while True:
        await asyncio.sleep(interval)
        sample = meter.sample(slots())
        if not sample:
            continue
        for sink in sinks:
            try:
                sink(sample)
            except Exception:
                log.exception("throughput report failed in %s", sink)
