"""GET /health and GET /v1/load: cheap answers that never wait on an engine."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.http.keys import MANAGER
from router.lifecycle import ModelSlot


async def health(request: web.Request) -> web.Response:
    # Reaching this handler means the router is up and (for a single-model
    # server) its model has loaded once: readiness_middleware answers before.
    return web.json_response({"status": "ok"})


def _model_load(slot: ModelSlot) -> dict[str, Any]:
    load: dict[str, Any] = {"id": slot.id, "state": slot.state.public, "in_flight": slot.in_flight}
    engine, ready = slot.engine, slot.ready
    if engine is None or ready is None:
        return load
    stats = engine.client.stats
    load["pid"] = engine.pid
    load["capacity"] = {
        "lanes": ready.kv.max_concurrency,
        "context": ready.kv.max_context,
        "kv_pages": ready.kv.num_pages,
        "kv_tokens": ready.kv.capacity_tokens,
    }
    load["requests"] = {
        "running": stats.running,
        "prefilling": stats.prefilling,
        "waiting": stats.waiting,
    }
    load["occupancy"] = {
        "lanes": stats.running / ready.kv.max_concurrency,
        "kv_pages": stats.kv_pages_used / max(ready.kv.num_pages, 1),
    }
    load["counters"] = {
        "prompt_tokens": stats.prompt_tokens_total,
        "cached_prompt_tokens": stats.cached_tokens_total,
        "generated_tokens": stats.generated_tokens_total,
        "preemptions": stats.preemptions_total,
        "steps": stats.steps_total,
    }
    return load


async def load(request: web.Request) -> web.Response:
    """What each model's engine published with its latest step; a GET names
    one model with ?model= (never loading or waking it)."""
    manager = request.app[MANAGER]
    name = request.query.get("model")
    slots = [manager.resolve(name)] if name else list(manager.slots.values())
    return web.json_response({"models": [_model_load(slot) for slot in slots]})
