"""Idle timers: --sleep-idle-seconds and --unload-idle-seconds.

Only requests count as use (a lease's start and end set last_used): polling
/models, /health or /v1/load never wakes or loads a model and never resets its
timer.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from router.lifecycle.slot import ModelSlot, ModelState

if TYPE_CHECKING:
    from router.lifecycle.manager import ModelManager

TICK_SECONDS = 0.25


def idle_action(slot: ModelSlot, now: float) -> str | None:
    """"sleep", "unload" or None for a model idle since slot.last_used."""
    if slot.in_flight or slot.pending or (slot.task is not None and not slot.task.done()):
        return None
    settings = slot.entry.settings
    idle = now - slot.last_used
    if slot.state is ModelState.LOADED:
        if settings.unload_idle_seconds and idle >= settings.unload_idle_seconds:
            return "unload"
        if settings.sleep_idle_seconds and idle >= settings.sleep_idle_seconds:
            return "sleep"
    elif slot.state is ModelState.SLEEPING:
        if settings.unload_idle_seconds and idle >= settings.unload_idle_seconds:
            return "unload"
    return None


async def watch_idle(manager: ModelManager) -> None:
    while True:
        await asyncio.sleep(TICK_SECONDS)
        now = time.monotonic()
        for slot in list(manager.slots.values()):
            action = idle_action(slot, now)
            if action == "unload":
                manager.spawn(manager.unload(slot, "the model was idle"), f"idle-unload-{slot.id}")
            elif action == "sleep":
                manager.spawn(manager.sleep(slot), f"idle-sleep-{slot.id}")
