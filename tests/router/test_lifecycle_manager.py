"""The lifecycle state machine with stand-in engines: races that real
processes make rare are made certain here."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import pytest

from protocol import Awake, EngineStats, KvFacts, ModelFacts, Ready, Slept
from router.catalog import Catalog, CatalogEntry
from router.config import ServeConfig
from router.lifecycle import transitions as transitions_module
from router.lifecycle.manager import ModelManager
from router.lifecycle.slot import ModelState

S = ModelState


class FakeClient:
    def __init__(self, log: list[str]):
        self.dead: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.stats = EngineStats()
        self.log = log

    async def sleep(self, weights: str) -> Slept:
        self.log.append("sleep")
        await asyncio.sleep(0.01)
        return Slept(0.01, 0, 0)

    async def wake(self) -> Awake:
        self.log.append("wake")
        await asyncio.sleep(0.01)
        return Awake(0.01)

    def fail_all(self, reason: str) -> None:
        if not self.dead.done():
            self.dead.set_result(reason)


class FakeEngine:
    """Stands in for router.supervisor.EngineProcess."""

    log: ClassVar[list[str]] = []

    def __init__(self, entry: CatalogEntry, run_dir: Path, serial: int):
        self.entry = entry
        self.pid = serial
        self.client = FakeClient(FakeEngine.log)
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.stopping = False

    async def start(self, ready_within: float, on_progress: Any) -> Ready:
        FakeEngine.log.append(f"start {self.entry.id}")
        await asyncio.sleep(0.01)
        facts = ModelFacts("LlamaForCausalLM", 10, 64, 8, 1, 1, 1, 0, 0, "float32", "cpu")
        return Ready(3, self.pid, facts, KvFacts(16, 8, 64, 4, 64, 0), 0.01)

    async def stop(self, reason: str = "") -> None:
        FakeEngine.log.append(f"stop {self.entry.id}")
        self.stopping = True
        if not self.exited.done():
            self.exited.set_result(0)
        self.client.fail_all(reason)

    async def kill(self, grace: float = 0.0) -> None:
        await self.stop("killed")


@pytest.fixture(autouse=True)
def fake_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeEngine.log = []
    monkeypatch.setattr(transitions_module, "EngineProcess", FakeEngine)


def catalog(*names: str) -> Catalog:
    return Catalog({name: CatalogEntry(name, Path(f"/models/{name}"), "hf") for name in names})


def router(*names: str, models_max: int = 0) -> ModelManager:
    config = ServeConfig(models_dir=Path("/models"), models_max=models_max, pending_timeout_ms=2000)
    return ModelManager(catalog(*names), config)


async def use(manager: ModelManager, name: str, hold: float = 0.0) -> None:
    slot = manager.slots[name]
    async with manager.lease(slot):
        await asyncio.sleep(hold)


def test_a_request_that_arrives_while_the_model_falls_asleep_wakes_it_once() -> None:
    async def scenario() -> None:
        manager = router("a")
        slot = manager.slots["a"]
        await manager.load(slot)
        # The idle timer starts a sleep; a request lands while it is under way.
        sleeping = asyncio.create_task(manager.sleep(slot))
        await asyncio.sleep(0)
        assert slot.state is S.SUSPENDING
        await asyncio.wait_for(use(manager, "a"), 2)
        await asyncio.wait_for(sleeping, 2)
        assert FakeEngine.log.count("sleep") == 1 and FakeEngine.log.count("wake") == 1
        assert slot.state is S.LOADED
        await manager.close()

    asyncio.run(scenario())


def test_sleep_refuses_a_model_that_requests_wait_for() -> None:
    async def scenario() -> None:
        manager = router("a")
        slot = manager.slots["a"]
        request = asyncio.create_task(use(manager, "a"))
        await asyncio.sleep(0)  # the request is waiting for the load
        with pytest.raises(Exception, match="in flight or waiting"):
            await manager.sleep(slot)
        await request
        await manager.close()

    asyncio.run(scenario())


def test_an_unload_while_requests_keep_coming_happens_once() -> None:
    async def scenario() -> None:
        manager = router("a")
        slot = manager.slots["a"]
        await manager.load(slot)
        unloading = asyncio.create_task(manager.unload(slot))
        await asyncio.sleep(0)
        # A request arriving during the unload loads the model again afterwards.
        await asyncio.wait_for(use(manager, "a"), 2)
        await asyncio.wait_for(unloading, 2)
        assert FakeEngine.log.count("stop a") == 1 and FakeEngine.log.count("start a") == 2
        assert slot.state is S.LOADED
        await manager.close()

    asyncio.run(scenario())


def test_waiters_for_room_are_served_in_arrival_order() -> None:
    async def scenario() -> None:
        manager = router("a", "b", "c", models_max=1)
        await manager.load(manager.slots["a"])
        busy = asyncio.create_task(use(manager, "a", hold=0.1))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(use(manager, "b"))
        await asyncio.sleep(0.01)
        third = asyncio.create_task(use(manager, "c"))
        await asyncio.wait_for(asyncio.gather(busy, second, third), 3)
        starts = [entry for entry in FakeEngine.log if entry.startswith("start")]
        assert starts == ["start a", "start b", "start c"]
        await manager.close()

    asyncio.run(scenario())
