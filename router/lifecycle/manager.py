"""The lifecycle's front door for handlers: a thin facade over three parts.

- router/lifecycle/roster.py (ModelRoster): the catalog side: names and
  aliases to slots, text sides, sampling defaults, reload's new slots.
- router/lifecycle/seats.py (SeatArbiter): device seats under --models-max
  and device memory per GPU: the arrival-order queue, where each model goes
  and which idle model makes room (router/lifecycle/placement.py describes
  what each model needs; router/devices.py reads the GPUs).
- router/lifecycle/transitions.py (ModelLifecycle): one per model, its state
  machine: load, wake, sleep, unload, and the watch for its engine's death.

The manager adds what spans them: leases (a request's hold on its model and
one of its engine's lanes), start-up work, and the shutdown drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from router.catalog import Catalog
from router.config import ServeConfig
from router.devices import CUPY_INSTALL, DeviceProbe, NvmlProbe, cuda_kernels_installed
from router.errors import RouterError, Unavailable
from router.lifecycle.admission import LaneQueue, LanesClosed
from router.lifecycle.events import ModelEvents
from router.lifecycle.placement import DeviceNeeds
from router.lifecycle.roster import ModelRoster
from router.lifecycle.seats import SeatArbiter
from router.lifecycle.slot import ModelSlot, ModelState
from router.lifecycle.transitions import (
    EXIT_ENGINE_FAILED,
    EXIT_STARTUP_FAILED,
    LifecycleShared,
    ModelLifecycle,
    ModelLoadFailed,
)
from router.observability.records import Observers, current_record
from router.sampling import SamplingDefaults
from router.supervisor import EngineProcess
from router.text.model_text import ModelText

log = logging.getLogger(__name__)

__all__ = ["EXIT_ENGINE_FAILED", "EXIT_STARTUP_FAILED", "ModelLoadFailed", "ModelManager"]

# A request that never reached its engine is tried on a restarted one at most
# this many times (the engine died while it waited for a lane).
ENGINE_RETRIES = 2
SHUTDOWN_MESSAGE = "the server is shutting down"
CUT_MESSAGE = ("the server is shutting down and the request did not finish within "
               "--shutdown-grace-seconds")


class ModelManager:
    def __init__(self, catalog: Catalog, config: ServeConfig, events: ModelEvents | None = None,
                 probe: DeviceProbe | None = None):
        """probe: the GPUs and their memory (NVML by default; tests pass a
        simulated one)."""
        self.config = config
        self.single = not config.is_router
        self.roster = ModelRoster(catalog, self.single)
        self.events = events or ModelEvents()
        self.observers = Observers()
        self.run_dir = Path(tempfile.mkdtemp(prefix="roundhouse-"))
        self.shutting_down = False
        # A single-model server is ready once its model first loads.
        self.ready_once = False
        # Set when a single-model server must exit: the status to exit with.
        self.fatal: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.needs = DeviceNeeds(config, probe if probe is not None else NvmlProbe(),
                                 lambda: self.slots.values())
        self.seats = SeatArbiter(
            config.models_max, config.pending_timeout_ms,
            start=lambda slot, placement: self.lifecycle(slot).start_in_seat(placement),
            evict=lambda slot, why: self.lifecycle(slot).evict(why),
            idle=lambda slot: (slot.state is ModelState.LOADED and slot.in_flight == 0
                               and slot.pending == 0),
            needs=self.needs, headroom_bytes=config.device_headroom_mib * 2**20,
        )
        self._shared = LifecycleShared(
            config=config, run_dir=self.run_dir, events=self.events, observers=self.observers,
            seats=self.seats, needs=self.needs, spawn=self.spawn, check_open=self._check_open,
            loaded=self._model_loaded, engine_failed=self._engine_failed,
        )
        self._lifecycles: dict[ModelSlot, ModelLifecycle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # /props: "available" (GPUs and CuPy), "cupy_missing" (GPUs, no CuPy:
        # the slow torch reference ops) or "no_gpu"; set by the GPUs' discovery.
        self.cuda_kernels = "no_gpu"

    # ---- the catalog side (router/lifecycle/roster.py) ------------------------------

    @property
    def catalog(self) -> Catalog:
        return self.roster.catalog

    @property
    def slots(self) -> dict[str, ModelSlot]:
        return self.roster.slots

    def resolve(self, name: str | None) -> ModelSlot:
        return self.roster.resolve(name)

    def named(self, name: str) -> ModelSlot:
        return self.roster.named(name)

    async def text_for(self, slot: ModelSlot) -> ModelText:
        return await self.roster.text_for(slot)

    def sampling_defaults(self, slot: ModelSlot) -> SamplingDefaults:
        return self.roster.sampling_defaults(slot)

    # ---- one model's lifecycle (router/lifecycle/transitions.py) ----------------------

    def lifecycle(self, slot: ModelSlot) -> ModelLifecycle:
        found = self._lifecycles.get(slot)
        if found is None:
            found = self._lifecycles[slot] = ModelLifecycle(slot, self._shared)
        return found

    def forget(self, slot: ModelSlot) -> None:
        """A reload dropped or replaced this (unloaded) slot."""
        self._lifecycles.pop(slot, None)

    # ---- requests ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, slot: ModelSlot, *, autoload: bool = True,
                    on_admit: Callable[[ModelSlot], None] | None = None,
                    ) -> AsyncIterator[EngineProcess]:
        """Hold the model loaded while a request uses it (loading or waking it
        first), then one of its engine's lanes (router/lifecycle/admission.py);
        the request counts as use for the idle timers. Waiting for room and
        for a lane together is bounded by --pending-timeout-ms from arrival.

        `on_admit(slot)` runs once the model is LOADED (its engine's facts
        known) and before the wait for a lane: a check that needs them (the
        context length) refuses there; what it raises propagates and the
        lease gives back what it took.

        A request whose engine dies before it was submitted (it waited for a
        lane) is not lost: with --models-dir it waits for the model to load
        again; a single-model server (which exits) answers 503 engine_failed.
        """
        record = current_record.get()
        if record is not None:
            # Known before admission, so a refusal (429, timeout) names it too.
            record.model = slot.id
        arrived = record.arrived if record is not None else time.monotonic()
        deadline = arrived + self.config.pending_timeout_ms / 1000
        lifecycle = self.lifecycle(slot)
        engine, lanes, count = await self._admit(lifecycle, autoload, deadline, on_admit)
        try:
            if record is not None:
                record.admit(slot.id)
            yield engine
        finally:
            lanes.leave(count)
            lifecycle.release_use()

    async def _admit(self, lifecycle: ModelLifecycle, autoload: bool, deadline: float,
                     on_admit: Callable[[ModelSlot], None] | None,
                     ) -> tuple[EngineProcess, LaneQueue, int]:
        """The engine, the lane queue entered and its lane count."""
        slot = lifecycle.slot
        for attempt in range(ENGINE_RETRIES + 1):
            await lifecycle.acquire(autoload, deadline)
            engine, lanes = slot.engine, slot.lanes
            assert engine is not None and slot.ready is not None
            count = slot.lane_count
            try:
                if on_admit is not None:
                    on_admit(slot)
                await lanes.enter(count, self.config.max_pending_requests, deadline)
            except LanesClosed as closed:
                lifecycle.release_use()
                if closed.code == "shutting_down" or self.shutting_down:
                    raise Unavailable(SHUTDOWN_MESSAGE, code="shutting_down",
                                      retry_after=5) from None
                reason = closed.reason
            except BaseException:
                lifecycle.release_use()
                raise
            else:
                if slot.engine is engine and not engine.client.dead.done():
                    return engine, lanes, count
                # The lane came free because the engine died this very moment.
                lanes.leave(count)
                lifecycle.release_use()
                reason = "the engine failed"
            # No second try where the model would not load by itself: a
            # single-model server exits, and autoload off means what it says.
            if self.single or not autoload or attempt == ENGINE_RETRIES:
                raise Unavailable(f"model '{slot.id}': {reason}", code="engine_failed",
                                  retry_after=1)
            log.warning("model %s: a request that waited for the engine that failed tries "
                        "again on a new one", slot.id)
        raise AssertionError("unreachable")

    # ---- explicit operations -------------------------------------------------------

    async def load(self, slot: ModelSlot) -> None:
        """POST /models/load?wait=1 (and start-up): return once the model is
        loaded (or awake)."""
        await self.lifecycle(slot).bring_up(time.monotonic() + self.config.pending_timeout_ms / 1000)
        slot.last_used = time.monotonic()

    async def begin_load(self, slot: ModelSlot) -> None:
        """POST /models/load: start the load (or wake, or the wait for a seat)
        and return; how it ends shows in GET /models and on /models/sse."""
        self._check_open()
        if slot.state is ModelState.LOADED:
            slot.last_used = time.monotonic()
            return
        self.spawn(self._load_in_background(slot, "POST /models/load"), f"load-{slot.id}")
        # One turn of the loop: the task asks for its seat, and the load
        # starts now when one is free.
        await asyncio.sleep(0)

    async def unload(self, slot: ModelSlot, reason: str = "the model was unloaded") -> None:
        """POST /models/unload: waits for requests in flight, never cancels
        them. It unloads once: requests that arrive later load it again."""
        await self.lifecycle(slot).unload(reason)

    async def sleep(self, slot: ModelSlot) -> None:
        """POST /models/sleep (and the idle timer): 409 while requests are in
        flight or waiting for the model."""
        await self.lifecycle(slot).sleep()

    # ---- what lifecycles report -------------------------------------------------------

    def _check_open(self) -> None:
        if self.shutting_down:
            raise Unavailable(SHUTDOWN_MESSAGE, code="shutting_down", retry_after=5)

    def _model_loaded(self) -> None:
        self.ready_once = True

    def _engine_failed(self, at_start: bool) -> None:
        """A single-model server exits when its engine fails, so that its
        supervisor restarts it: 1 if it never served, else 2."""
        status = EXIT_STARTUP_FAILED if at_start and not self.ready_once else EXIT_ENGINE_FAILED
        if self.single and not self.shutting_down and not self.fatal.done():
            self.fatal.set_result(status)

    # ---- start-up and shutdown ---------------------------------------------------------

    def start(self) -> None:
        """Background work once the port is bound: the GPUs' discovery, the
        single model's load, models with load-on-startup, and the idle timers."""
        from router.lifecycle.idle import watch_idle

        self.spawn(self._discover_devices(), "devices")
        for slot in self.slots.values():
            if self.single or slot.entry.settings.load_on_startup:
                self.spawn(self._load_in_background(slot, "start-up"), f"startup-{slot.id}")
        self.spawn(watch_idle(self), "idle-timers")

    async def _discover_devices(self) -> None:
        found = await self.needs.discover()
        if not found:
            log.info("no GPU found: models with device auto run on the CPU")
            return
        log.info("GPUs for models: %s (headroom %d MiB each)", ", ".join(
            f"{d.index} {d.name} {d.total_bytes / 2**30:.1f} GiB ({d.free_bytes / 2**30:.1f} "
            "free)" for d in found), self.config.device_headroom_mib)
        self.cuda_kernels = "available" if cuda_kernels_installed() else "cupy_missing"
        if self.cuda_kernels == "cupy_missing":
            log.warning("CUDA GPUs are present but CuPy is not installed: engines on a GPU run "
                        "the slow torch reference ops without our CUDA kernels or CUDA graphs. "
                        "Install it with: %s", CUPY_INSTALL)

    async def _load_in_background(self, slot: ModelSlot, why: str) -> None:
        try:
            await self.load(slot)
        except RouterError as exc:
            # A failed load is in GET /models and on /models/sse as well.
            log.error("loading %s (%s) failed: %s", slot.id, why, exc.message)

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run background work the manager owns (cancelled at shutdown)."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # Retrieve the exception: waiters re-raise it, nobody may be waiting.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    @property
    def in_flight(self) -> int:
        return sum(slot.in_flight for slot in self.slots.values())

    def begin_shutdown(self) -> None:
        """Stop admitting: new requests, and queued ones that no engine has
        seen yet, get 503 shutting_down now; running ones go on (drain())."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self.seats.refuse_all(Unavailable(SHUTDOWN_MESSAGE, code="shutting_down", retry_after=5))
        for slot in self.slots.values():
            slot.lanes.close(SHUTDOWN_MESSAGE, code="shutting_down")
            self.lifecycle(slot).changed()

    async def drain(self, grace: float, hurry: asyncio.Event | None = None) -> bool:
        """Wait until no request runs, at most `grace` seconds (or until
        `hurry` is set); True when none is left."""
        deadline = time.monotonic() + grace
        while self.in_flight:
            left = deadline - time.monotonic()
            if left <= 0 or (hurry is not None and hurry.is_set()):
                return False
            # Shutdown only: a short poll is simpler than one more event.
            await asyncio.sleep(min(left, 0.05))
        return True

    async def close(self, reason: str = CUT_MESSAGE) -> None:
        """End what still runs and stop every engine (router shutdown):
        requests still running get an error (`reason`), engines get Abort
        for them and then Shutdown, and exit 0."""
        self.begin_shutdown()
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        engines = [s.engine for s in self.slots.values() if s.engine is not None]
        await asyncio.gather(*(e.stop(reason, "shutting_down") for e in engines),
                             return_exceptions=True)
        self.events.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

