"""GET /health, GET /v1/load and GET /stats: cheap answers that never wait on
an engine (they read what the engines published with their latest step)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.http.keys import MANAGER
from router.lifecycle import ModelManager, ModelSlot

# Waiters /stats shows per model.
QUEUE_HEAD = 5


async def health(request: web.Request) -> web.Response:
    # Reaching this handler means the router is up and (for a single-model
    # server) its model has loaded once: readiness_middleware answers before.
    return web.json_response({"status": "ok"})


def model_load(manager: ModelManager, slot: ModelSlot) -> dict[str, Any]:
    """One model's snapshot for load balancers."""
    load: dict[str, Any] = {"id": slot.id, "state": slot.state.public, "in_flight": slot.in_flight,
                            "counters": _counters(slot)}
    engine, ready = slot.engine, slot.ready
    if engine is None or ready is None:
        return load
    stats = engine.client.stats
    lanes = ready.kv.max_concurrency
    admitted = slot.lanes.active
    load["pid"] = engine.pid
    load["capacity"] = {
        "lanes": lanes,
        "pending": manager.config.max_pending_requests,
        "context": ready.kv.max_context,
        "kv_pages": ready.kv.num_pages,
        "kv_tokens": ready.kv.capacity_tokens,
    }
    load["requests"] = {
        # Holding a lane (submitted to the engine).
        "admitted": admitted,
        "running": stats.running,
        "prefilling": stats.prefilling,
        # Waiting for a lane in the router, or for KV in the engine.
        "waiting": slot.lanes.waiting + stats.waiting,
    }
    load["occupancy"] = {
        "lanes": admitted / lanes,
        "kv_pages": stats.kv_pages_used / max(ready.kv.num_pages, 1),
    }
    return load


def _counters(slot: ModelSlot) -> dict[str, int]:
    totals = slot.counters()
    return {
        "prompt_tokens": int(totals["prompt_tokens_total"]),
        "cached_prompt_tokens": int(totals["cached_tokens_total"]),
        "generated_tokens": int(totals["generated_tokens_total"]),
        "preemptions": int(totals["preemptions_total"]),
        "steps": int(totals["steps_total"]),
    }


def _slots(request: web.Request) -> list[ModelSlot]:
    manager = request.app[MANAGER]
    name = request.query.get("model")
    return [manager.resolve(name)] if name else list(manager.slots.values())


async def load(request: web.Request) -> web.Response:
    """What each model's engine published with its latest step; a GET names
    one model with ?model= (never loading or waking it)."""
    manager = request.app[MANAGER]
    return web.json_response({"models": [model_load(manager, slot) for slot in _slots(request)]})


async def stats(request: web.Request) -> web.Response:
    """/v1/load plus the peak admitted count and the head of each lane queue."""
    manager = request.app[MANAGER]
    models = []
    for slot in _slots(request):
        entry = model_load(manager, slot)
        entry["peak_admitted"] = slot.lanes.peak_active
        entry["queue"] = [{"position": i, "waited_seconds": round(waited, 3)}
                          for i, waited in enumerate(slot.lanes.waits(QUEUE_HEAD))]
        models.append(entry)
    return web.json_response({"models": models})
