"""Room under --models-max: requests that need a model slot queue for one in
arrival order, and the least recently used idle model is evicted for them.

A mixin of ModelManager (router/lifecycle/manager.py), which owns the state
it reads: slots, config, the waiters and the transitions it starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.errors import QueueTimeout
from router.lifecycle.slot import ModelSlot, ModelState

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

S = ModelState


@dataclass(eq=False)
class RoomWaiter:
    slot: ModelSlot
    granted: asyncio.Future[None]


class RoomKeeping:
    async def _wait_for_room(self, slot: ModelSlot, deadline: float) -> None:
        """Queue (in arrival order) until the model can load or wake; its
        transition has started when this returns."""
        waiter = RoomWaiter(slot, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._pump()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            limit = self.config.models_max
            raise QueueTimeout(
                f"every model slot is busy (--models-max {limit}); waited "
                f"{self.config.pending_timeout_ms} ms for one", code="models_busy",
                retry_after=1,
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

    def _grant(self, waiter: RoomWaiter) -> None:
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

