"""The work behind each lifecycle transition: load, wake, sleep and unload a
model's engine, and notice an engine that dies.

A mixin of ModelManager (router/lifecycle/manager.py): each method runs as the
slot's one transition task (ModelManager._start) and ends by setting the
slot's next state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from protocol import LoadProgress
from router.engine_client import EngineFailure
from router.lifecycle.slot import ModelSlot, ModelState
from router.supervisor import EngineProcess

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

S = ModelState
# Exit statuses of a single-model server, for its supervisor (systemd).
EXIT_STARTUP_FAILED = 1
EXIT_ENGINE_FAILED = 2
# An engine that reported EngineDead exits by itself; its status is worth waiting for.
FAILED_ENGINE_GRACE_SECONDS = 5.0


class ModelLoadFailed(Exception):
    pass


class Transitions:
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

