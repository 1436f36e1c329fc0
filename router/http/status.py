"""GET /health, GET /v1/load and GET /stats: cheap answers that never wait on
an engine (they read what the engines published with their latest step).

/v1/load speaks the field names of llama.cpp-style load balancers: per model
`object`, `model`, `capacity` (max_concurrency, max_pending_requests,
max_context, kv_capacity_tokens, kv_capacity_pages), `requests` and
`occupancy`. A single-model server answers with that one object (plus
`uptime_seconds`); a router with `{"object": "list", "uptime_seconds",
"models": [...]}`. docs/observability.md lists every field."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from router.errors import Unavailable
from router.http.keys import MANAGER, STARTED
from router.http.models_api import device_memory, public_id
from router.lifecycle import ModelManager, ModelSlot

# Waiters /stats shows per model.
QUEUE_HEAD = 5


async def health(request: web.Request) -> web.Response:
    # Reaching this handler means the router is up and (for a single-model
    # server) its model has loaded once: readiness_middleware answers before.
    # While it drains after SIGTERM, load balancers must take it out of rotation.
    if request.app[MANAGER].shutting_down:
        raise Unavailable("the server is shutting down", code="shutting_down", retry_after=5)
    return web.json_response({"status": "ok"})


def model_load(manager: ModelManager, slot: ModelSlot) -> dict[str, Any]:
    """One model's snapshot for load balancers, in the names llama.cpp-style
    balancers read (capacity.max_concurrency, max_context, kv_capacity_*)."""
    load: dict[str, Any] = {"object": "load", "model": public_id(manager, slot),
                            "state": slot.state.public, "in_flight": slot.in_flight,
                            "counters": _counters(slot),
                            "memory": device_memory(manager, slot)}
    engine, ready = slot.engine, slot.ready
    if engine is None or ready is None:
        return load
    stats = engine.client.stats
    kv = ready.kv
    admitted = slot.lanes.active
    load["pid"] = engine.pid
    load["capacity"] = {
        "max_concurrency": kv.max_concurrency,
        "max_pending_requests": manager.config.max_pending_requests,
        "max_context": kv.max_context,
        "kv_capacity_tokens": kv.capacity_tokens,
        "kv_capacity_pages": kv.num_pages,
        "kv_page_tokens": kv.page_size,
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
        "kv_pages": stats.kv_pages_used,
        # Tokens whose K/V running requests hold (pages can be part full).
        "kv_tokens": stats.kv_tokens_used,
        "kv_fraction": stats.kv_pages_used / max(kv.num_pages, 1),
        "lane_fraction": admitted / kv.max_concurrency,
        # The prefix cache's host tier: pages held, and its capacity (0: off).
        "host_kv_pages": stats.host_kv_pages_cached,
        "host_kv_capacity_pages": stats.host_kv_pages_total,
        # The disk tier: page files held, their bytes, and its budget (0: off).
        "disk_kv_pages": stats.disk_kv_pages_cached,
        "disk_kv_bytes": stats.disk_kv_bytes_cached,
        "disk_kv_capacity_bytes": stats.disk_kv_capacity_bytes,
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
        # Of cached_prompt_tokens, those the host tier served.
        "host_kv_hit_tokens": int(totals["host_kv_hit_tokens_total"]),
        "host_kv_misses": int(totals["host_kv_misses_total"]),
        "host_kv_stored_pages": int(totals["host_kv_stored_pages_total"]),
        "host_kv_evicted_pages": int(totals["host_kv_evicted_pages_total"]),
        "host_kv_bytes_to_host": int(totals["host_kv_bytes_to_host_total"]),
        "host_kv_bytes_to_device": int(totals["host_kv_bytes_to_device_total"]),
        # Of cached_prompt_tokens, those the disk tier served.
        "disk_kv_hit_tokens": int(totals["disk_kv_hit_tokens_total"]),
        "disk_kv_misses": int(totals["disk_kv_misses_total"]),
        "disk_kv_written_pages": int(totals["disk_kv_written_pages_total"]),
        "disk_kv_evicted_pages": int(totals["disk_kv_evicted_pages_total"]),
        "disk_kv_bytes_read": int(totals["disk_kv_bytes_read_total"]),
        "disk_kv_bytes_written": int(totals["disk_kv_bytes_written_total"]),
        "disk_kv_corrupt_pages": int(totals["disk_kv_corrupt_pages_total"]),
        "disk_kv_dropped_pages": int(totals["disk_kv_dropped_pages_total"]),
        "disk_kv_orphan_pages": int(totals["disk_kv_orphan_pages_total"]),
        "disk_kv_deadline_hits": int(totals["disk_kv_deadline_hits_total"]),
        "disk_kv_skipped": int(totals["disk_kv_skipped_total"]),
        # Of cached_prompt_tokens, those reused to the token from a page
        # beyond the whole pages (engine/kv/partial_pages.py).
        "partial_kv_hits": int(totals["partial_kv_hits_total"]),
        "partial_kv_hit_tokens": int(totals["partial_kv_hit_tokens_total"]),
    }


def device_ledger(manager: ModelManager) -> list[dict[str, Any]]:
    """Each GPU the planner places models on, read now: its total and free
    memory, what our models hold or are planned to hold, what other
    processes hold, and the headroom kept free (empty without GPUs)."""
    return [{"index": book.index, "name": book.name, "total_bytes": book.total_bytes,
             "free_bytes": book.free_bytes, "planned_bytes": planned,
             "other_bytes": book.other_bytes, "headroom_bytes": book.headroom_bytes}
            for book, planned in manager.seats.books()]


def _slots(request: web.Request) -> list[ModelSlot]:
    manager = request.app[MANAGER]
    name = request.query.get("model")
    return [manager.resolve(name)] if name else list(manager.slots.values())


def _answer(request: web.Request, models: list[dict[str, Any]]) -> web.Response:
    """A single-model server answers with its model's object, a router with
    the list; both say how long the server has been up."""
    uptime = round(time.time() - request.app[STARTED], 3)
    manager = request.app[MANAGER]
    devices = device_ledger(manager)
    if manager.single:
        (one,) = models
        return web.json_response({**one, "uptime_seconds": uptime, "devices": devices})
    return web.json_response({"object": "list", "uptime_seconds": uptime, "devices": devices,
                              "models": models})


async def load(request: web.Request) -> web.Response:
    """What each model's engine published with its latest step; a GET names
    one model with ?model= (never loading or waking it)."""
    manager = request.app[MANAGER]
    return _answer(request, [model_load(manager, slot) for slot in _slots(request)])


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
    return _answer(request, models)
