"""Rescanning --models-dir and --models-preset (GET /models?reload=1, SIGHUP).

As llama.cpp's router does: a model that is running but was removed or changed
(path or options) is unloaded (its requests finish first); a model that is not
running is simply added, updated or dropped. Watchers get a `model_remove`
event per removed model and one `models_reload` event (model "*") at the end.
A preset that no longer parses leaves the catalog as it was.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from router.catalog import build_catalog
from router.lifecycle.slot import ModelState

if TYPE_CHECKING:
    from router.lifecycle.manager import ModelManager

log = logging.getLogger(__name__)


async def reload_catalog(manager: ModelManager) -> dict[str, list[str]]:
    """Apply a fresh scan; returns the ids added, removed and changed.
    Raises ValueError (with file and line for a preset) when the scan fails."""
    fresh = await asyncio.to_thread(build_catalog, manager.config)
    roster = manager.roster
    summary = roster.diff(fresh)
    for entry_id in summary["removed"] + summary["changed"]:
        slot = roster.slots[entry_id]
        if slot.state is not ModelState.UNLOADED:
            await manager.unload(slot, "the model was removed or changed by a catalog reload")
    for slot in roster.replace(fresh, summary):
        manager.forget(slot)
    for entry_id in summary["removed"]:
        manager.events.publish(entry_id, "model_remove")
    log.info("catalog reloaded: %s",
             ", ".join(f"{k} {v}" for k, v in summary.items() if v) or "no change")
    manager.events.publish("*", "models_reload")
    return summary
