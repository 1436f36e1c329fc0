"""The lifecycle state machine with stand-in engines: races that real
processes make rare are made certain here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from router.catalog import Catalog, CatalogEntry
from router.config import ServeConfig
from router.lifecycle.manager import ModelManager
from router.lifecycle.slot import ModelState
from tests.support.fake_engines import FakeEngine, use_fake_engines
from tests.support.simulated_devices import NoDevices

S = ModelState


@pytest.fixture(autouse=True)
def fake_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_engines(monkeypatch)


def catalog(*names: str) -> Catalog:
    return Catalog({name: CatalogEntry(name, Path(f"/models/{name}"), "hf") for name in names})


def router(*names: str, models_max: int = 0) -> ModelManager:
    config = ServeConfig(models_dir=Path("/models"), models_max=models_max, pending_timeout_ms=2000)
    # No GPUs, even on a host that has some: these models are stand-ins.
    return ModelManager(catalog(*names), config, probe=NoDevices())


async def use(manager: ModelManager, name: str, hold: float = 0.0) -> None:
    slot = manager.slots[name]
    async with manager.lease(slot):
        await asyncio.sleep(hold)


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until `condition` holds (2 s at most)."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def test_a_request_that_arrives_while_the_model_falls_asleep_wakes_it_once() -> None:
    async def scenario() -> None:
        manager = router("a")
        slot = manager.slots["a"]
        await manager.load(slot)
        # The idle timer starts a sleep; a request lands while it is under way.
        sleeping = asyncio.create_task(manager.sleep(slot))
        await until(lambda: slot.state is S.SUSPENDING)
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
        await until(lambda: slot.state is S.LOADING)  # the request is waiting for the load
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
        # One turn of the loop, not a wait: the stand-in engine stops at once,
        # so the model is UNLOADING for exactly this turn.
        await asyncio.sleep(0)
        assert slot.state is S.UNLOADING
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
        await until(lambda: manager.slots["a"].in_flight == 1)
        second = asyncio.create_task(use(manager, "b"))
        await until(lambda: manager.seats.waiting == 1)
        third = asyncio.create_task(use(manager, "c"))
        await asyncio.wait_for(asyncio.gather(busy, second, third), 3)
        starts = [entry for entry in FakeEngine.log if entry.startswith("start")]
        assert starts == ["start a", "start b", "start c"]
        await manager.close()

    asyncio.run(scenario())


def test_on_admit_runs_once_loaded_and_its_refusal_gives_back_the_lease() -> None:
    async def scenario() -> None:
        manager = router("a")
        slot = manager.slots["a"]
        seen: list[ModelState] = []

        def refuse(admitted: Any) -> None:
            seen.append(admitted.state)
            raise ValueError("prompt too long")

        with pytest.raises(ValueError, match="too long"):
            async with manager.lease(slot, on_admit=refuse):
                raise AssertionError("the lease must not be entered")
        assert seen == [S.LOADED]
        assert slot.in_flight == 0 and slot.lanes.active == 0
        async with manager.lease(slot, on_admit=seen.append):
            assert slot.lanes.active == 1
        assert len(seen) == 2
        await manager.close()

    asyncio.run(scenario())
