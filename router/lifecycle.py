"""Model lifecycles: load on demand, least-recently-used unload, failures.

    UNLOADED ──request──> LOADING ──Ready──> LOADED ──room/unload──> UNLOADING ──> UNLOADED
                             │                  │
                             └─fails─┐          └─engine dies─┐
                                     v                        v
                          UNLOADED (failed, error)   UNLOADED (failed, error)

A request holds a lease on its model for as long as it runs (in_flight). To
load a model while --models-max are active, the least recently used loaded
model with nothing in flight is unloaded first; when every one is busy, the
request waits for one to become idle (bounded by the room timeout). A failed
model is loaded again by its next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from protocol import LoadProgress, Ready
from router.catalog import CatalogEntry
from router.config import ServeConfig
from router.http.errors import ApiError
from router.supervisor import EngineProcess
from router.text.model_text import ModelText

log = logging.getLogger(__name__)


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(eq=False)
class ModelSlot:
    entry: CatalogEntry
    state: ModelState = ModelState.UNLOADED
    engine: EngineProcess | None = None
    ready: Ready | None = None
    in_flight: int = 0
    last_used: float = 0.0
    failed: bool = False
    error: str | None = None
    progress: float = 0.0
    load_task: asyncio.Task[None] | None = None
    text: ModelText | None = None
    text_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def max_context(self) -> int:
        assert self.ready is not None
        return self.ready.kv.max_context


class ModelLoadFailed(Exception):
    pass


class ModelManager:
    def __init__(self, catalog: dict[str, CatalogEntry], config: ServeConfig):
        self.config = config
        self.slots = {entry_id: ModelSlot(entry) for entry_id, entry in catalog.items()}
        self.single = config.model is not None
        self.run_dir = Path(tempfile.mkdtemp(prefix="roundhouse-"))
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._serial = 0
        self._monitors: set[asyncio.Task[None]] = set()

    # ---- naming ------------------------------------------------------------

    def resolve(self, name: str | None) -> ModelSlot:
        """The slot a request means: its `model`, else the most recently used."""
        if self.single:
            # As llama.cpp's server does, a single-model server serves whatever
            # name the client sends (many send "gpt-3.5-turbo" and the like).
            return next(iter(self.slots.values()))
        if name:
            slot = self.slots.get(name)
            if slot is None:
                raise ApiError(404, f"model '{name}' not found; GET /v1/models lists the models",
                               type="invalid_request_error", code="model_not_found", param="model")
            return slot
        loaded = [s for s in self.slots.values() if s.state is ModelState.LOADED]
        if loaded:
            return max(loaded, key=lambda s: s.last_used)
        raise ApiError(400, "this server holds several models: name one in 'model'",
                       type="invalid_request_error", code="missing_required_parameter", param="model")

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

    # ---- leases ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, slot: ModelSlot) -> AsyncIterator[EngineProcess]:
        """Hold the model loaded while a request uses it."""
        await self._acquire(slot)
        try:
            assert slot.engine is not None
            yield slot.engine
        finally:
            slot.in_flight -= 1
            slot.last_used = time.monotonic()
            self._notify()

    async def _acquire(self, slot: ModelSlot) -> None:
        while True:
            if slot.state is ModelState.LOADED:
                slot.in_flight += 1
                slot.last_used = time.monotonic()
                return
            if slot.state is ModelState.LOADING and slot.load_task is not None:
                try:
                    await asyncio.shield(slot.load_task)
                except ModelLoadFailed as exc:
                    raise ApiError(503, f"model '{slot.id}' failed to load: {exc}",
                                   code="model_load_failed") from None
                continue
            if slot.state is ModelState.UNLOADING:
                await self._wait_change(None)
                continue
            async with self._lock:
                if slot.state is ModelState.UNLOADED:
                    await self._make_room()
                    self._start_load(slot)

    def preload(self, slot: ModelSlot) -> None:
        """Start loading now (a single-model server loads at start-up)."""
        if slot.state is ModelState.UNLOADED:
            self._start_load(slot)

    # ---- transitions ---------------------------------------------------------

    def _active(self) -> list[ModelSlot]:
        return [s for s in self.slots.values() if s.state is not ModelState.UNLOADED]

    async def _make_room(self) -> None:
        limit = self.config.models_max
        if not limit:
            return
        deadline = asyncio.get_running_loop().time() + self.config.room_timeout
        while len(self._active()) >= limit:
            idle = [s for s in self._active() if s.state is ModelState.LOADED and s.in_flight == 0]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                log.info("unloading %s (least recently used) to make room (--models-max %d)",
                         victim.id, limit)
                await self._unload(victim)
                continue
            if not await self._wait_change(deadline):
                raise ApiError(
                    503,
                    f"all {limit} model slots are busy (--models-max {limit}); try again shortly",
                    code="models_busy",
                    headers={"Retry-After": "1"},
                )

    async def _wait_change(self, deadline: float | None) -> bool:
        self._changed.clear()
        timeout = None if deadline is None else deadline - asyncio.get_running_loop().time()
        if timeout is not None and timeout <= 0:
            return False
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _notify(self) -> None:
        self._changed.set()

    def _set_state(self, slot: ModelSlot, state: ModelState) -> None:
        log.info("model %s: %s -> %s", slot.id, slot.state.value, state.value)
        slot.state = state
        self._notify()

    def _start_load(self, slot: ModelSlot) -> None:
        slot.failed = False
        slot.error = None
        slot.progress = 0.0
        self._set_state(slot, ModelState.LOADING)
        slot.load_task = asyncio.create_task(self._load(slot), name=f"load-{slot.id}")
        # Retrieve the exception so an unobserved failure doesn't warn.
        slot.load_task.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _load(self, slot: ModelSlot) -> None:
        self._serial += 1
        engine = EngineProcess(slot.entry, self.config.engine, self.run_dir, self._serial)
        slot.engine = engine

        def on_progress(event: LoadProgress) -> None:
            slot.progress = event.fraction

        try:
            ready = await engine.start(self.config.load_timeout, on_progress)
        except Exception as exc:
            await engine.kill()
            slot.engine = None
            slot.failed = True
            slot.error = str(exc)
            log.error("model %s failed to load: %s", slot.id, exc)
            self._set_state(slot, ModelState.UNLOADED)
            raise ModelLoadFailed(str(exc)) from exc
        slot.ready = ready
        slot.progress = 1.0
        log.info("model %s loaded in %.1fs (pid %d, context %d, %d KV pages)",
                 slot.id, ready.load_seconds, ready.pid, ready.kv.max_context, ready.kv.num_pages)
        self._set_state(slot, ModelState.LOADED)
        monitor = asyncio.create_task(self._watch(slot, engine), name=f"watch-{slot.id}")
        self._monitors.add(monitor)
        monitor.add_done_callback(self._monitors.discard)

    async def _watch(self, slot: ModelSlot, engine: EngineProcess) -> None:
        """One monitor per engine: an engine that dies while loaded fails its
        requests (EngineClient.fail_all) and leaves the model failed."""
        dead = asyncio.ensure_future(asyncio.shield(engine.client.dead))
        await asyncio.wait({dead, engine.exited}, return_when=asyncio.FIRST_COMPLETED)
        dead.cancel()
        if engine.stopping or slot.engine is not engine:
            return
        reason = engine.client.dead.result() if engine.client.dead.done() else (
            f"engine process exited with status {engine.exited.result()}")
        log.error("model %s: engine (pid %s) failed: %s", slot.id, engine.pid, reason)
        slot.failed = True
        slot.error = reason
        slot.engine = None
        slot.ready = None
        await engine.kill()
        self._set_state(slot, ModelState.UNLOADED)

    async def _unload(self, slot: ModelSlot) -> None:
        engine = slot.engine
        self._set_state(slot, ModelState.UNLOADING)
        if engine is not None:
            await engine.stop()
        slot.engine = None
        slot.ready = None
        self._set_state(slot, ModelState.UNLOADED)

    async def close(self) -> None:
        """Stop every engine (router shutdown)."""
        for slot in self.slots.values():
            if slot.load_task is not None and not slot.load_task.done():
                slot.load_task.cancel()
        engines = [s.engine for s in self.slots.values() if s.engine is not None]
        await asyncio.gather(*(engine.stop() for engine in engines), return_exceptions=True)
        for task in self._monitors:
            task.cancel()
        shutil.rmtree(self.run_dir, ignore_errors=True)
