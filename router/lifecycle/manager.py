"""Drives every model through the lifecycle of router/lifecycle/slot.py.

Requests take a lease on their model (load or wake it first if needed) and
hold it while they run. Loading or waking needs a device slot under
--models-max: requests that need one queue for it in arrival order (bounded by
--pending-timeout-ms), and the least recently used idle model is evicted to
make room: put to sleep when it runs with --model-suspend, else unloaded.
Busy models (requests in flight) are never evicted. Every transition runs as
one task per model, is logged, and is published on the event stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import LoadProgress
from router.catalog import Catalog
from router.config import ServeConfig
from router.engine_client import EngineFailure
from router.http.errors import ApiError
from router.lifecycle.events import ModelEvents
from router.lifecycle.slot import ModelSlot, ModelState
from router.observability.records import Observers, current_record
from router.sampling import SamplingDefaults
from router.supervisor import EngineProcess
from router.text.model_text import ModelText

log = logging.getLogger(__name__)

S = ModelState
# Exit statuses of a single-model server, for its supervisor (systemd).
EXIT_STARTUP_FAILED = 1
EXIT_ENGINE_FAILED = 2
# An engine that reported EngineDead exits by itself; its status is worth waiting for.
FAILED_ENGINE_GRACE_SECONDS = 5.0


class ModelLoadFailed(Exception):
    pass


@dataclass(eq=False)
class _RoomWaiter:
    slot: ModelSlot
    granted: asyncio.Future[None]


class ModelManager:
    def __init__(self, catalog: Catalog, config: ServeConfig, events: ModelEvents | None = None):
        self.config = config
        self.catalog = catalog
        self.slots = {entry_id: ModelSlot(entry) for entry_id, entry in catalog.entries.items()}
        self.single = not config.is_router
        self.events = events or ModelEvents()
        self.observers = Observers()
        self.run_dir = Path(tempfile.mkdtemp(prefix="roundhouse-"))
        self.shutting_down = False
        # A single-model server is ready once its model first loads.
        self.ready_once = False
        # Set when a single-model server must exit: the status to exit with.
        self.fatal: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters: list[_RoomWaiter] = []
        self._pumping = False
        self._pump_again = False
        self._change = asyncio.Event()
        self._serial = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._defaults: dict[object, SamplingDefaults] = {}

    # ---- names and text --------------------------------------------------------

    def resolve(self, name: str | None) -> ModelSlot:
        """The slot a request means: its `model` (or alias), else the most
        recently used loaded model."""
        if self.single:
            # As llama.cpp's server does, a single-model server serves whatever
            # name the client sends (many send "gpt-3.5-turbo" and the like).
            return next(iter(self.slots.values()))
        if name:
            entry = self.catalog.find(name)
            if entry is None:
                raise ApiError(404, f"model '{name}' not found; GET /models lists the models",
                               code="model_not_found", param="model")
            return self.slots[entry.id]
        loaded = [s for s in self.slots.values() if s.state is S.LOADED]
        if loaded:
            return max(loaded, key=lambda s: s.last_used)
        if len(self.slots) == 1:
            return next(iter(self.slots.values()))
        raise ApiError(400, "this server holds several models and none is loaded: name one in 'model'",
                       code="missing_required_parameter", param="model")

    async def text_for(self, slot: ModelSlot) -> ModelText:
        """Tokenizer and template, read from the model's files without loading it."""
        if slot.text is None:
            async with slot.text_lock:
                if slot.text is None:
                    try:
                        slot.text = await asyncio.to_thread(ModelText.load, slot.entry.path)
                    except (OSError, ValueError) as exc:
                        raise ApiError(503, f"model '{slot.id}' has no usable tokenizer: {exc}",
                                       code="model_load_failed") from exc
        return slot.text

    def sampling_defaults(self, slot: ModelSlot) -> SamplingDefaults:
        """The model's defaults for sampling fields a request leaves out;
        keyed by its catalog entry, so a reload that changes it starts afresh."""
        entry = slot.entry
        if entry not in self._defaults:
            self._defaults[entry] = SamplingDefaults.for_model(entry.path, entry.settings.sampling)
        return self._defaults[entry]

    def output_budget(self, slot: ModelSlot, prompt_tokens: int, asked: int | None) -> int:
        """max_tokens for a request: what it asked for, else --default-max-tokens,
        else one lane's share of the KV pool (so every lane can run at once),
        always within the context left after the prompt; running out ends the
        generation with finish_reason "length"."""
        room = slot.max_context - prompt_tokens
        if asked is not None:
            return min(asked, room)
        if self.config.default_max_tokens:
            return min(self.config.default_max_tokens, room)
        assert slot.ready is not None
        share = slot.ready.kv.capacity_tokens // slot.ready.kv.max_concurrency
        return max(min(share, room), 1)

    # ---- requests ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, slot: ModelSlot, *, autoload: bool = True) -> AsyncIterator[EngineProcess]:
        """Hold the model loaded while a request uses it (loading or waking it
        first), then one of its engine's lanes (router/lifecycle/admission.py);
        the request counts as use for the idle timers. Waiting for room and
        for a lane together is bounded by --pending-timeout-ms from arrival."""
        record = current_record.get()
        if record is not None:
            # Known before admission, so a refusal (429, timeout) names it too.
            record.model = slot.id
        arrived = record.arrived if record is not None else time.monotonic()
        deadline = arrived + self.config.pending_timeout_ms / 1000
        await self._acquire(slot, autoload, deadline)
        try:
            lanes = slot.lane_count
            await slot.lanes.enter(lanes, self.config.max_pending_requests, deadline)
            try:
                if record is not None:
                    record.admit(slot.id)
                assert slot.engine is not None
                yield slot.engine
            finally:
                slot.lanes.leave(lanes)
        finally:
            slot.in_flight -= 1
            slot.last_used = time.monotonic()
            if slot.in_flight == 0:
                self._changed()

    async def _acquire(self, slot: ModelSlot, autoload: bool, deadline: float) -> None:
        while True:
            self._check_open()
            state = slot.state
            if state is S.LOADED:
                slot.in_flight += 1
                slot.last_used = time.monotonic()
                return
            if state is S.UNLOADED and not autoload:
                raise ApiError(503, f"model '{slot.id}' is not loaded and autoload is off; "
                               "POST /models/load loads it", code="model_not_loaded")
            await self._bring_up(slot, deadline)

    async def load(self, slot: ModelSlot) -> None:
        """POST /models/load: return once the model is loaded (or awake)."""
        await self._bring_up(slot, time.monotonic() + self.config.pending_timeout_ms / 1000)
        slot.last_used = time.monotonic()

    async def _bring_up(self, slot: ModelSlot, deadline: float) -> None:
        """Make the model LOADED: load or wake it under --models-max, or wait
        for the transition under way. Raises 503 if a load it waited on fails.

        While a request is here its model counts as wanted (`pending`), so a
        model that just loaded for it is not evicted before the request gets
        to use it.
        """
        slot.pending += 1
        try:
            await self._bring_up_wanted(slot, deadline)
        finally:
            slot.pending -= 1

    async def _bring_up_wanted(self, slot: ModelSlot, deadline: float) -> None:
        while slot.state is not S.LOADED:
            self._check_open()
            if slot.state in (S.UNLOADED, S.SLEEPING):
                await self._wait_for_room(slot, deadline)
            elif slot.state in (S.LOADING, S.WAKING):
                assert slot.task is not None
                try:
                    await asyncio.shield(slot.task)
                except ModelLoadFailed as exc:
                    raise ApiError(503, f"model '{slot.id}' failed to load: {exc}",
                                   code="model_load_failed") from None
            else:  # SUSPENDING or UNLOADING: let it settle first
                await self._wait_change()

    # ---- explicit operations -------------------------------------------------------

    async def unload(self, slot: ModelSlot, reason: str = "the model was unloaded") -> None:
        """POST /models/unload: waits for requests in flight, never cancels
        them. It unloads once: requests that arrive later load it again."""
        while slot.state is not S.UNLOADED:
            if slot.state in (S.LOADED, S.SLEEPING):
                self._start(slot, S.UNLOADING, self._unload(slot, reason))
                await self._settle(slot)
                return
            await self._settle(slot)

    async def sleep(self, slot: ModelSlot) -> None:
        """POST /models/sleep (and the idle timer): 409 while requests are in
        flight or waiting for the model. It puts the model to sleep once; a
        request that wakes it afterwards wins."""
        while True:
            state = slot.state
            if state is S.SLEEPING:
                return
            if state is S.SUSPENDING:
                await self._settle(slot)
                return
            if state in (S.UNLOADED, S.UNLOADING):
                raise ApiError(409, f"model '{slot.id}' is not loaded", code="model_not_loaded")
            if slot.in_flight or slot.pending:
                busy = slot.in_flight + slot.pending
                raise ApiError(409, f"model '{slot.id}' has {busy} request(s) in flight or waiting; "
                               "try again when it is idle", code="model_busy")
            if state is S.LOADED:
                self._start(slot, S.SUSPENDING, self._sleep(slot))
                await self._settle(slot)
                return
            await self._settle(slot)  # LOADING or WAKING

    async def _settle(self, slot: ModelSlot) -> None:
        """Wait for the transition under way (its failure is the caller's
        next look at the state, not an exception here)."""
        task = slot.task
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        else:
            await self._wait_change()

    # ---- room under --models-max -------------------------------------------------

    async def _wait_for_room(self, slot: ModelSlot, deadline: float) -> None:
        """Queue (in arrival order) until the model can load or wake; its
        transition has started when this returns."""
        waiter = _RoomWaiter(slot, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._pump()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            limit = self.config.models_max
            raise ApiError(
                503, f"every model slot is busy (--models-max {limit}); waited "
                f"{self.config.pending_timeout_ms} ms for one", code="models_busy",
                headers={"Retry-After": "1"},
            ) from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                # A waiter that leaves may unblock the ones behind it.
                self._pump()

    def _pump(self) -> None:
        """Grant room to waiters in order, evicting idle models as needed.

        State changes inside call back into _pump; those calls are folded
        into another round of the outer one.
        """
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            self._pump_again = True
            while self._pump_again:
                self._pump_again = False
                self._pump_round()
        finally:
            self._pumping = False

    def _pump_round(self) -> None:
        limit = self.config.models_max
        for waiter in list(self._waiters):
            if waiter.granted.done() or waiter.slot.state in (S.LOADED, S.LOADING, S.WAKING):
                self._grant(waiter)
        while self._waiters:
            waiter = self._waiters[0]
            slot = waiter.slot
            if slot.state not in (S.UNLOADED, S.SLEEPING):
                return  # it is settling (SUSPENDING, UNLOADING); asked again when done
            if not limit or sum(s.state.holds_device for s in self.slots.values()) < limit:
                if slot.state is S.SLEEPING:
                    self._start(slot, S.WAKING, self._wake(slot))
                else:
                    self._start(slot, S.LOADING, self._load(slot))
                self._grant(waiter)
                continue
            if any(s.state in (S.SUSPENDING, S.UNLOADING) for s in self.slots.values()):
                return  # an eviction is under way
            idle = [s for s in self.slots.values()
                    if s.state is S.LOADED and s.in_flight == 0 and s.pending == 0]
            if idle:
                self._evict(min(idle, key=lambda s: s.last_used))
            return

    def _grant(self, waiter: _RoomWaiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if not waiter.granted.done():
            waiter.granted.set_result(None)

    def _evict(self, slot: ModelSlot) -> None:
        limit = self.config.models_max
        if slot.entry.settings.model_suspend:
            log.info("putting %s to sleep (least recently used) to make room (--models-max %d)",
                     slot.id, limit)
            self._start(slot, S.SUSPENDING, self._sleep(slot))
        else:
            log.info("unloading %s (least recently used) to make room (--models-max %d)", slot.id, limit)
            self._start(slot, S.UNLOADING, self._unload(slot, "the model was unloaded to make room"))

    # ---- transitions -----------------------------------------------------------------

    def _start(self, slot: ModelSlot, state: ModelState, work: Coroutine[Any, Any, None]) -> None:
        self._set_state(slot, state)
        slot.task = self._spawn(work, f"{state.value}-{slot.id}")

    def _spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # Retrieve the exception: waiters re-raise it, nobody may be waiting.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _load(self, slot: ModelSlot) -> None:
        slot.failed, slot.error, slot.exit_code, slot.progress = False, None, None, 0.0
        self._serial += 1
        engine = EngineProcess(slot.entry, self.run_dir, self._serial)
        slot.engine = engine

        def on_progress(event: LoadProgress) -> None:
            slot.progress = event.fraction
            self.events.publish(slot.id, "model_status", {
                "status": "loading",
                "progress": {"stages": ["weights"], "current": "weights", "value": round(event.fraction, 4)},
            })

        started = time.monotonic()
        try:
            ready = await engine.start(slot.entry.settings.load_timeout, on_progress)
        except Exception as exc:
            await engine.kill(grace=FAILED_ENGINE_GRACE_SECONDS)
            self._fail(slot, engine, str(exc))
            self._exit_if_single(EXIT_ENGINE_FAILED if self.ready_once else EXIT_STARTUP_FAILED)
            raise ModelLoadFailed(str(exc)) from exc
        slot.ready = ready
        slot.progress = 1.0
        slot.last_used = time.monotonic()
        log.info("model %s loaded in %.1fs (pid %d, context %d, %d KV pages)",
                 slot.id, ready.load_seconds, ready.pid, ready.kv.max_context, ready.kv.num_pages)
        self.ready_once = True
        self.observers.model_event(slot.id, "load", time.monotonic() - started)
        self._set_state(slot, S.LOADED, {"info": {
            "pid": ready.pid, "load_seconds": round(ready.load_seconds, 3),
            "n_ctx": ready.kv.max_context, "device": ready.model.device,
        }})
        self._spawn(self._watch(slot, engine), f"watch-{slot.id}")

    async def _wake(self, slot: ModelSlot) -> None:
        engine = slot.engine
        assert engine is not None
        started = time.monotonic()
        try:
            awake = await asyncio.wait_for(engine.client.wake(), slot.entry.settings.load_timeout)
        except (EngineFailure, TimeoutError) as exc:
            reason = str(exc) or "the engine did not wake in time"
            await engine.kill()
            self._fail(slot, engine, reason)
            self._exit_if_single(EXIT_ENGINE_FAILED)
            raise ModelLoadFailed(reason) from exc
        slot.last_used = time.monotonic()
        log.info("model %s woke in %.2fs", slot.id, awake.seconds)
        self.observers.model_event(slot.id, "wake", time.monotonic() - started)
        self._set_state(slot, S.LOADED)

    async def _sleep(self, slot: ModelSlot) -> None:
        engine = slot.engine
        assert engine is not None
        weights = slot.entry.settings.suspend_weights
        started = time.monotonic()
        try:
            slept = await engine.client.sleep(weights)
        except EngineFailure:
            return  # the engine died; _watch marks the model failed
        log.info("model %s asleep in %.2fs (weights: %s, %d KV pages kept, %d device bytes still held)",
                 slot.id, slept.seconds, weights, slept.kept_pages, slept.device_bytes)
        self.observers.model_event(slot.id, "sleep", time.monotonic() - started)
        if slot.engine is engine:
            self._set_state(slot, S.SLEEPING)

    async def _unload(self, slot: ModelSlot, reason: str) -> None:
        # Requests in flight finish first; new ones wait for the unload and
        # then load the model again.
        while slot.in_flight:
            await self._wait_change()
        engine = slot.engine
        started = time.monotonic()
        slot.retire_engine_counters()
        if engine is not None:
            await engine.stop(reason)
        self.observers.model_event(slot.id, "unload", time.monotonic() - started)
        slot.engine = None
        slot.ready = None
        self._set_state(slot, S.UNLOADED)

    async def _watch(self, slot: ModelSlot, engine: EngineProcess) -> None:
        """One monitor per engine: one that dies on its own fails its requests
        (EngineClient.fail_all) and leaves the model UNLOADED and failed."""
        dead = asyncio.ensure_future(asyncio.shield(engine.client.dead))
        await asyncio.wait({dead, engine.exited}, return_when=asyncio.FIRST_COMPLETED)
        dead.cancel()
        if engine.stopping or slot.engine is not engine:
            return
        reason = engine.client.dead.result() if engine.client.dead.done() else (
            f"engine process exited with status {engine.exited.result()}")
        log.error("model %s: engine (pid %s) failed: %s", slot.id, engine.pid, reason)
        await engine.kill(grace=FAILED_ENGINE_GRACE_SECONDS)
        self._fail(slot, engine, reason)
        self._exit_if_single(EXIT_ENGINE_FAILED)

    def _fail(self, slot: ModelSlot, engine: EngineProcess, reason: str) -> None:
        if slot.engine is not engine:
            return
        slot.retire_engine_counters()
        slot.engine = None
        slot.ready = None
        slot.failed = True
        slot.error = reason
        slot.exit_code = engine.exited.result() if engine.exited.done() else None
        log.error("model %s failed: %s", slot.id, reason)
        self.observers.model_event(slot.id, "fail", 0.0)
        self._set_state(slot, S.UNLOADED)

    def _exit_if_single(self, status: int) -> None:
        if self.single and not self.shutting_down and not self.fatal.done():
            self.fatal.set_result(status)

    # ---- state changes ---------------------------------------------------------------

    def _set_state(self, slot: ModelSlot, state: ModelState, extra: dict[str, Any] | None = None) -> None:
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
            self.events.publish(slot.id, "model_status", data)
        self._changed()

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()
        self._pump()

    async def _wait_change(self) -> None:
        await self._change.wait()

    def _check_open(self) -> None:
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", code="shutting_down",
                           headers={"Retry-After": "5"})

    # ---- start-up and shutdown ---------------------------------------------------------

    def start(self) -> None:
        """Background work once the port is bound: the single model's load,
        models with load-on-startup, and the idle timers."""
        from router.lifecycle.idle import watch_idle

        for slot in self.slots.values():
            if self.single or slot.entry.settings.load_on_startup:
                self._spawn(self._load_in_background(slot), f"startup-{slot.id}")
        self._spawn(watch_idle(self), "idle-timers")

    async def _load_in_background(self, slot: ModelSlot) -> None:
        try:
            await self.load(slot)
        except ApiError as exc:
            log.error("loading %s at start-up failed: %s", slot.id, exc.message)

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run background work the manager owns (cancelled at shutdown)."""
        return self._spawn(work, name)

    def begin_shutdown(self) -> None:
        """Stop admitting: queued requests get 503 now; in-flight ones when
        their engines stop (close())."""
        self.shutting_down = True
        for waiter in self._waiters:
            if not waiter.granted.done():
                waiter.granted.set_exception(ApiError(
                    503, "the server is shutting down", code="shutting_down"))
        self._waiters.clear()
        self._changed()

    async def close(self) -> None:
        """Stop every engine (router shutdown)."""
        self.begin_shutdown()
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        engines = [s.engine for s in self.slots.values() if s.engine is not None]
        await asyncio.gather(*(e.stop("the server is shutting down") for e in engines),
                             return_exceptions=True)
        self.events.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
