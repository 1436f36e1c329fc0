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
from pathlib import Path
from typing import Any

from router.catalog import Catalog
from router.config import ServeConfig
from router.errors import Conflict, InvalidRequest, RouterError, Unavailable, model_not_found
from router.lifecycle.events import ModelEvents
from router.lifecycle.room import RoomKeeping, RoomWaiter
from router.lifecycle.slot import ModelSlot, ModelState
from router.lifecycle.transitions import (
    EXIT_ENGINE_FAILED,
    EXIT_STARTUP_FAILED,
    ModelLoadFailed,
    Transitions,
)
from router.observability.records import Observers, current_record
from router.sampling import SamplingDefaults
from router.supervisor import EngineProcess
from router.text.model_text import ModelText

log = logging.getLogger(__name__)

S = ModelState

__all__ = ["EXIT_ENGINE_FAILED", "EXIT_STARTUP_FAILED", "ModelLoadFailed", "ModelManager"]


class ModelManager(RoomKeeping, Transitions):
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
        self._waiters: list[RoomWaiter] = []
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
                raise model_not_found(name)
            return self.slots[entry.id]
        loaded = [s for s in self.slots.values() if s.state is S.LOADED]
        if loaded:
            return max(loaded, key=lambda s: s.last_used)
        if len(self.slots) == 1:
            return next(iter(self.slots.values()))
        raise InvalidRequest("this server holds several models and none is loaded: name one in "
                             "'model'", code="missing_required_parameter", param="model")

    async def text_for(self, slot: ModelSlot) -> ModelText:
        """Tokenizer and template, read from the model's files without loading it."""
        if slot.text is None:
            async with slot.text_lock:
                if slot.text is None:
                    try:
                        slot.text = await asyncio.to_thread(ModelText.load, slot.entry.path)
                    except (OSError, ValueError) as exc:
                        raise Unavailable(f"model '{slot.id}' has no usable tokenizer: {exc}",
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
                raise Unavailable(f"model '{slot.id}' is not loaded and autoload is off; "
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
                    raise Unavailable(f"model '{slot.id}' failed to load: {exc}",
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
                raise Conflict(f"model '{slot.id}' is not loaded", code="model_not_loaded")
            if slot.in_flight or slot.pending:
                busy = slot.in_flight + slot.pending
                raise Conflict(f"model '{slot.id}' has {busy} request(s) in flight or waiting; "
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
            raise Unavailable("the server is shutting down", code="shutting_down", retry_after=5)

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
        except RouterError as exc:
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
                waiter.granted.set_exception(Unavailable(
                    "the server is shutting down", code="shutting_down", retry_after=5))
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
