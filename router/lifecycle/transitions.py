"""One model's lifecycle: the state machine of router/lifecycle/slot.py,
driven for one slot.

ModelLifecycle brings its model up for requests (load or wake, once a device
seat is granted by router/lifecycle/seats.py), puts it to sleep, unloads it,
and watches its engine for death. Each transition runs as the slot's one
task, is logged (`model X: loaded -> suspending`) and is published on the
event stream when the public status changes. What it needs from the server
(configuration, events, the seat arbiter, the single-model exit policy)
comes in one LifecycleShared, never by reaching into another object.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from protocol import LoadProgress
from router.catalog import CatalogEntry
from router.config import ServeConfig
from router.engine_client import EngineFailure
from router.errors import Conflict, InvalidRequest, Unavailable
from router.heap import freeze_long_lived
from router.lifecycle.admission import LaneQueue
from router.lifecycle.events import ModelEvents
from router.lifecycle.placement import DeviceNeeds, Placement
from router.lifecycle.seats import Eviction, SeatArbiter
from router.lifecycle.slot import ModelSlot, ModelState
from router.observability.records import Observers
from router.supervisor import EngineProcess

log = logging.getLogger(__name__)

S = ModelState
# Exit statuses of a single-model server, for its supervisor (systemd).
EXIT_STARTUP_FAILED = 1
EXIT_ENGINE_FAILED = 2
# An engine that reported EngineDead exits by itself; its status is worth waiting for.
FAILED_ENGINE_GRACE_SECONDS = 5.0


class ModelLoadFailed(Exception):
    pass


@dataclass
class LifecycleShared:
    """What every model's lifecycle uses and the manager provides."""

    config: ServeConfig
    run_dir: Path
    events: ModelEvents
    observers: Observers
    seats: SeatArbiter
    # Each model's demand on the devices (router/lifecycle/placement.py).
    needs: DeviceNeeds
    spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]
    # Raises 503 shutting_down once the server stops admitting.
    check_open: Callable[[], None]
    # A model loaded (a single-model server is ready from then on).
    loaded: Callable[[], None]
    # An engine failed: at its start (True) or later (False).
    engine_failed: Callable[[bool], None]
    serials: itertools.count[int] = field(default_factory=lambda: itertools.count(1))


class ModelLifecycle:
    def __init__(self, slot: ModelSlot, shared: LifecycleShared):
        self.slot = slot
        self._shared = shared
        self._change = asyncio.Event()

    # ---- requests ------------------------------------------------------------------

    async def acquire(self, autoload: bool, deadline: float) -> None:
        """Count one request in flight on the LOADED model, loading or waking
        it first. Give it back with release_use()."""
        slot = self.slot
        while True:
            self._shared.check_open()
            if slot.state is S.LOADED:
                slot.in_flight += 1
                slot.last_used = time.monotonic()
                return
            if slot.state is S.UNLOADED and not autoload:
                # llama.cpp's router answers 400 here too: the client asked
                # for a model it must load first.
                raise InvalidRequest(
                    f"model '{slot.id}' is not loaded and autoload is off; POST /models/load "
                    "loads it", code="model_not_loaded", param="model")
            await self.bring_up(deadline)

    def release_use(self) -> None:
        slot = self.slot
        slot.in_flight -= 1
        slot.last_used = time.monotonic()
        if slot.in_flight == 0:
            self.changed()

    async def bring_up(self, deadline: float) -> None:
        """Make the model LOADED: load or wake it once a seat is granted, or
        wait for the transition under way. Raises 503 if a load it waited on
        fails.

        While a request is here its model counts as wanted (`pending`), so a
        model that just loaded for it is not evicted before the request gets
        to use it.
        """
        slot = self.slot
        slot.pending += 1
        try:
            await self._bring_up(deadline)
        finally:
            # No reconsider here: acquire() counts the request in flight next,
            # and between the two the model must not look idle.
            slot.pending -= 1

    async def _bring_up(self, deadline: float) -> None:
        slot = self.slot
        while slot.state is not S.LOADED:
            self._shared.check_open()
            if slot.state in (S.UNLOADED, S.SLEEPING):
                # The checkpoint's shapes are read off the loop before the
                # planner needs them.
                await self._shared.needs.prepare(slot)
                await self._shared.seats.request(slot, deadline)
            elif slot.state in (S.LOADING, S.WAKING):
                task = slot.task
                assert task is not None
                try:
                    await asyncio.shield(task)
                except ModelLoadFailed as exc:
                    raise Unavailable(f"model '{slot.id}' failed to load: {exc}",
                                      code="model_load_failed") from None
                except asyncio.CancelledError:
                    if not task.cancelled():
                        raise  # this request was cancelled (its client left)
                    # The load was cancelled (server shutdown): check_open says so.
            else:  # SUSPENDING or UNLOADING: let it settle first
                await self.wait_change()

    # ---- explicit operations -------------------------------------------------------

    async def unload(self, reason: str = "the model was unloaded") -> None:
        """Waits for requests in flight, never cancels them. It unloads once:
        requests that arrive later load it again."""
        slot = self.slot
        while slot.state is not S.UNLOADED:
            if slot.state in (S.LOADED, S.SLEEPING):
                self._start(S.UNLOADING, self._unload(reason))
                await self.settle()
                return
            await self.settle()

    async def sleep(self) -> None:
        """409 while requests are in flight or waiting for the model. It puts
        the model to sleep once; a request that wakes it afterwards wins."""
        slot = self.slot
        while True:
            state = slot.state
            if state is S.SLEEPING:
                return
            if state is S.SUSPENDING:
                await self.settle()
                return
            if state in (S.UNLOADED, S.UNLOADING):
                raise Conflict(f"model '{slot.id}' is not loaded", code="model_not_loaded")
            if slot.in_flight or slot.pending:
                busy = slot.in_flight + slot.pending
                raise Conflict(f"model '{slot.id}' has {busy} request(s) in flight or waiting; "
                               "try again when it is idle", code="model_busy")
            if state is S.LOADED:
                self._start(S.SUSPENDING, self._sleep())
                await self.settle()
                return
            await self.settle()  # LOADING or WAKING

    async def settle(self) -> None:
        """Wait for the transition under way (its failure is the caller's
        next look at the state, not an exception here)."""
        task = self.slot.task
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        else:
            await self.wait_change()

    # ---- the seat arbiter's calls ------------------------------------------------

    def start_in_seat(self, placement: Placement) -> bool:
        """A seat was granted (on `placement`'s device): begin the load or
        wake. False while the model is still settling into UNLOADED or
        SLEEPING."""
        slot = self.slot
        if slot.state is S.SLEEPING:
            # A wake stays on its engine's device; the load's placement stands.
            slot.placement = slot.placement or placement
            self._start(S.WAKING, self._wake())
            return True
        if slot.state is S.UNLOADED:
            slot.placement = placement
            self._start(S.LOADING, self._load())
            return True
        return False

    def evict(self, why: Eviction) -> None:
        """Give the seat back to make room: sleep with --model-suspend, else unload."""
        slot = self.slot
        action = "sleep" if slot.entry.settings.model_suspend else "unload"
        if why.reason == "device_memory":
            room = f"device memory on GPU {why.gpu}"
        else:
            room = f"a seat under --models-max {self._shared.seats.limit}"
        log.info("%s %s (least recently used) to make room for %s: %s",
                 "putting to sleep" if action == "sleep" else "unloading", slot.id, why.for_model,
                 room)
        device = slot.placement.engine_device if slot.placement is not None else None
        self._shared.events.publish(slot.id, "model_evict", {
            "reason": why.reason, "for_model": why.for_model, "action": action,
            "device": device})
        self._shared.observers.model_evicted(slot.id, action, why.reason, why.for_model, device)
        if action == "sleep":
            self._start(S.SUSPENDING, self._sleep())
        else:
            self._start(S.UNLOADING, self._unload("the model was unloaded to make room"))

    # ---- state changes -------------------------------------------------------------

    def changed(self) -> None:
        """Wake whoever waits on this model, and let the arbiter look again."""
        self._change.set()
        self._change = asyncio.Event()
        self._shared.seats.reconsider()

    async def wait_change(self) -> None:
        await self._change.wait()

    def _start(self, state: ModelState, work: Coroutine[Any, Any, None]) -> None:
        if state in (S.SUSPENDING, S.UNLOADING):
            # Before the state changes, so the arbiter waits for this seat
            # instead of evicting another model.
            self._shared.seats.releasing(self.slot)
        self.slot.task = self._shared.spawn(work, f"{state.value}-{self.slot.id}")
        self._set_state(state)

    def _set_state(self, state: ModelState, extra: dict[str, Any] | None = None) -> None:
        slot = self.slot
        previous = slot.state
        if previous is state:
            return
        log.info("model %s: %s -> %s", slot.id, previous.value, state.value)
        slot.state = state
        if previous.public != state.public:
            data: dict[str, Any] = {"status": state.public}
            if state is S.UNLOADED and slot.failed:
                data.update(failed=True, error=slot.error)
                if slot.exit_code is not None:
                    data["exit_code"] = slot.exit_code
            data.update(extra or {})
            self._shared.events.publish(slot.id, "model_status", data)
        if state in (S.UNLOADED, S.SLEEPING):
            self._shared.seats.release(slot)
        self.changed()

    # ---- the work of each transition --------------------------------------------------

    async def _load(self) -> None:
        slot, shared = self.slot, self._shared
        slot.failed, slot.error, slot.exit_code, slot.progress = False, None, None, 0.0
        engine = EngineProcess(self._launch_entry(), shared.run_dir, next(shared.serials))
        slot.engine = engine

        def on_progress(event: LoadProgress) -> None:
            slot.progress = event.fraction
            shared.events.publish(slot.id, "model_status", {
                "status": "loading",
                "progress": {"stages": ["weights"], "current": "weights",
                             "value": round(event.fraction, 4)},
            })

        started = time.monotonic()
        try:
            ready = await engine.start(slot.entry.settings.load_timeout, on_progress)
        except Exception as exc:
            await engine.kill(grace=FAILED_ENGINE_GRACE_SECONDS)
            self._fail(engine, str(exc))
            shared.engine_failed(True)
            raise ModelLoadFailed(str(exc)) from exc
        slot.ready = ready
        shared.needs.remember(slot)
        slot.progress = 1.0
        slot.last_used = time.monotonic()
        # Lanes belong to one engine: requests that waited on a dead one's
        # were told so when it died.
        slot.lanes = LaneQueue()
        log.info("model %s loaded in %.1fs (pid %d, context %d, %d KV pages)",
                 slot.id, ready.load_seconds, ready.pid, ready.kv.max_context, ready.kv.num_pages)
        shared.loaded()
        # The model's text state (tokenizer, template) lives until its unload;
        # others may be streaming, so no full collection now.
        freeze_long_lived(collect_first=False)
        shared.observers.model_event(slot.id, "load", time.monotonic() - started)
        self._set_state(S.LOADED, {"info": {
            "pid": ready.pid, "load_seconds": round(ready.load_seconds, 3),
            "n_ctx": ready.kv.max_context, "device": ready.model.device,
        }})
        shared.spawn(self._watch(engine), f"watch-{slot.id}")

    def _launch_entry(self) -> CatalogEntry:
        """The catalog entry as this load runs it: on the device the planner
        chose, within its grant; a pool that fills the grant when the model
        is alone on its GPU or was given a share, and kv-capacity is left at 0."""
        entry, placement = self.slot.entry, self.slot.placement
        if placement is None:
            return entry
        engine = entry.settings.engine
        changes: dict[str, Any] = {"device": placement.engine_device}
        if placement.gpu is not None:
            changes["device_memory_mib"] = placement.grant_mib
            # A model alone on its GPU, or given its share (device-memory-mib),
            # fills what it is given with KV, unless kv-capacity says otherwise.
            given_share = engine.device_memory_mib > 0
            if (placement.fill or given_share) and engine.kv_capacity_tokens == 0:
                changes["kv_capacity_tokens"] = -1
        settings = dataclasses.replace(entry.settings,
                                       engine=msgspec.structs.replace(engine, **changes))
        return dataclasses.replace(entry, settings=settings)

    async def _wake(self) -> None:
        slot, shared = self.slot, self._shared
        engine = slot.engine
        assert engine is not None
        started = time.monotonic()
        try:
            awake = await asyncio.wait_for(engine.client.wake(), slot.entry.settings.load_timeout)
        except (EngineFailure, TimeoutError) as exc:
            reason = str(exc) or "the engine did not wake in time"
            await engine.kill(grace=FAILED_ENGINE_GRACE_SECONDS)
            self._fail(engine, reason)
            shared.engine_failed(False)
            raise ModelLoadFailed(reason) from exc
        slot.last_used = time.monotonic()
        log.info("model %s woke in %.2fs", slot.id, awake.seconds)
        shared.observers.model_event(slot.id, "wake", time.monotonic() - started)
        self._set_state(S.LOADED)

    async def _sleep(self) -> None:
        slot = self.slot
        engine = slot.engine
        assert engine is not None
        weights = slot.entry.settings.suspend_weights
        started = time.monotonic()
        try:
            slept = await engine.client.sleep(weights)
        except EngineFailure:
            return  # the engine died; _watch marks the model failed
        log.info("model %s asleep in %.2fs (weights: %s, %d KV pages kept, %d device bytes "
                 "still held)", slot.id, slept.seconds, weights, slept.kept_pages,
                 slept.device_bytes)
        self._shared.observers.model_event(slot.id, "sleep", time.monotonic() - started)
        if slot.engine is engine:
            self._set_state(S.SLEEPING)

    async def _unload(self, reason: str) -> None:
        slot = self.slot
        # Requests in flight finish first; new ones wait for the unload and
        # then load the model again.
        while slot.in_flight:
            await self.wait_change()
        engine = slot.engine
        started = time.monotonic()
        slot.retire_engine_counters()
        slot.lanes.close(reason)
        if engine is not None:
            await engine.stop(reason)
        self._shared.observers.model_event(slot.id, "unload", time.monotonic() - started)
        slot.engine = None
        slot.ready = None
        self._set_state(S.UNLOADED)

    async def _watch(self, engine: EngineProcess) -> None:
        """One monitor per engine: one that dies on its own fails its requests
        (EngineClient.fail_all), closes its lanes and leaves the model
        UNLOADED and failed."""
        dead = asyncio.ensure_future(asyncio.shield(engine.client.dead))
        await asyncio.wait({dead, engine.exited}, return_when=asyncio.FIRST_COMPLETED)
        dead.cancel()
        if engine.stopping or self.slot.engine is not engine:
            return
        reason = engine.client.dead.result() if engine.client.dead.done() else (
            f"engine process exited with status {engine.exited.result()}")
        log.error("model %s: engine (pid %s) failed: %s", self.slot.id, engine.pid, reason)
        await engine.kill(grace=FAILED_ENGINE_GRACE_SECONDS)
        self._fail(engine, reason)
        self._shared.engine_failed(False)

    def _fail(self, engine: EngineProcess, reason: str) -> None:
        slot = self.slot
        if slot.engine is not engine:
            return
        slot.retire_engine_counters()
        slot.lanes.close(f"the engine failed: {reason}")
        slot.engine = None
        slot.ready = None
        slot.failed = True
        slot.error = reason
        slot.exit_code = engine.exited.result() if engine.exited.done() else None
        log.error("model %s failed: %s", slot.id, reason)
        self._shared.observers.model_event(slot.id, "fail", 0.0)
        self._set_state(S.UNLOADED)
