"""Stand-ins for router.supervisor.EngineProcess: the router's lifecycle,
planner and metrics driven without engine processes, so races that real
processes make rare are made certain.

    fake_engines(monkeypatch)          # every engine the router starts is a FakeEngine
    FakeEngine.log, FakeEngine.started # what happened, in order

A subclass changes what an engine reports or holds (tests/router/test_device_planner.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import pytest

from protocol import (
    PROTOCOL_VERSION,
    Awake,
    EngineStats,
    KvFacts,
    MemoryFacts,
    ModelFacts,
    Ready,
    Slept,
)
from router.catalog import CatalogEntry
from router.lifecycle import transitions as transitions_module

# How long a fake sleep, wake or start takes: long enough for requests to race it.
TRANSITION_SECONDS = 0.01


class FakeClient:
    """The engine's end of the sockets, as the lifecycle uses it."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.dead: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.stats = EngineStats()

    async def sleep(self, weights: str) -> Slept:
        FakeEngine.log.append("sleep")
        await asyncio.sleep(TRANSITION_SECONDS)
        self.engine.slept()
        return Slept(TRANSITION_SECONDS, 0, 0)

    async def wake(self) -> Awake:
        FakeEngine.log.append("wake")
        await asyncio.sleep(TRANSITION_SECONDS)
        self.engine.woke()
        return Awake(TRANSITION_SECONDS)

    def fail_all(self, reason: str) -> None:
        if not self.dead.done():
            self.dead.set_result(reason)


class FakeEngine:
    # Every engine started, and what the engines did ("start a", "sleep", ...).
    started: ClassVar[list[FakeEngine]] = []
    log: ClassVar[list[str]] = []

    def __init__(self, entry: CatalogEntry, run_dir: Path, serial: int):
        self.entry = entry
        self.options = entry.settings.engine
        self.pid = serial
        self.client = FakeClient(self)
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.stopping = False
        FakeEngine.started.append(self)

    # ---- what a subclass may change ---------------------------------------------------

    def memory(self) -> MemoryFacts:
        return MemoryFacts()

    def started_up(self) -> None:
        """The engine is about to report Ready (a subclass may fail here)."""

    def slept(self) -> None:
        pass

    def woke(self) -> None:
        pass

    def stopped(self) -> None:
        pass

    # ---- EngineProcess's interface ------------------------------------------------------

    async def start(self, ready_within: float, on_progress: Any) -> Ready:
        FakeEngine.log.append(f"start {self.entry.id}")
        await asyncio.sleep(TRANSITION_SECONDS)
        self.started_up()
        facts = ModelFacts("LlamaForCausalLM", 10, 64, 8, 1, 1, 1, 0, 0, "float32",
                           self.options.device)
        return Ready(PROTOCOL_VERSION, self.pid, facts, KvFacts(16, 8, 64, 4, 64, 0),
                     TRANSITION_SECONDS, memory=self.memory())

    async def stop(self, reason: str = "", code: str = "engine_failed") -> None:
        FakeEngine.log.append(f"stop {self.entry.id}")
        self.stopping = True
        self.stopped()
        if not self.exited.done():
            self.exited.set_result(0)
        self.client.fail_all(reason)

    async def kill(self, grace: float = 0.0) -> None:
        await self.stop("killed")

    def die(self) -> None:
        """The engine process dies on its own (the manager's monitor notices)."""
        self.client.fail_all("killed")


def use_fake_engines(monkeypatch: pytest.MonkeyPatch, engine: type[FakeEngine] = FakeEngine) -> None:
    """Every engine the router's lifecycles start is `engine`; the records start empty."""
    FakeEngine.started = []
    FakeEngine.log = []
    monkeypatch.setattr(transitions_module, "EngineProcess", engine)
