"""The model catalog over HTTP, as llama.cpp's router serves it.

GET /models (and /v1/models)    every model with its status; ?reload=1 rescans
POST /models/load               {"model": ID}: load (or wake) it, answer when done
POST /models/unload             {"model": ID}: unload once its requests finish
POST /models/sleep              {"model": ID}: release its device memory (409 when busy)
GET /models/sse                 one event per status change, load progress, keep-alives

None of these count as use of a model: they never reset its idle timers.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from router.http.errors import ApiError, decode_body
from router.http.keys import MANAGER, STARTED
from router.lifecycle import ModelSlot
from router.lifecycle.reload import reload_catalog
from router.supervisor import engine_args

# Seconds between keep-alive comments on an idle event stream.
KEEPALIVE_SECONDS = 5.0


class ModelRequest(msgspec.Struct):
    model: str


def model_card(slot: ModelSlot, created: int) -> dict[str, Any]:
    state = slot.state
    status: dict[str, Any] = {"value": state.public}
    if state.public != "unloaded" or slot.failed:
        status["args"] = engine_args(slot.entry)
    if slot.failed:
        status["failed"] = True
        status["error"] = slot.error
        if slot.exit_code is not None:
            status["exit_code"] = slot.exit_code
    if state.public == "loading":
        status["progress"] = {"value": round(slot.progress, 4)}
    card: dict[str, Any] = {
        "id": slot.id,
        "object": "model",
        "created": created,
        "owned_by": "roundhouse",
        "aliases": list(slot.entry.settings.aliases),
        "path": str(slot.entry.path),
        "status": status,
    }
    ready = slot.ready
    if ready is not None and state.public in ("loaded", "sleeping"):
        context = ready.kv.max_context
        card.update(max_model_len=context, context_window=context, context_length=context)
        facts = ready.model
        card["meta"] = {
            "n_vocab": facts.n_vocab,
            "n_ctx": context,
            "n_ctx_train": facts.n_ctx_train,
            "n_embd": facts.n_embd,
            "n_params": facts.n_params,
            "size": facts.size_bytes,
        }
    return card


async def list_models(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    if request.query.get("reload", "0").lower() in ("1", "true", "yes"):
        try:
            await reload_catalog(manager)
        except ValueError as exc:
            raise ApiError(400, f"reload failed, catalog unchanged: {exc}", code="reload_failed") from None
    created = request.app[STARTED]
    return web.json_response({
        "object": "list",
        "data": [model_card(slot, created) for slot in manager.slots.values()],
    })


async def _named_slot(request: web.Request) -> ModelSlot:
    body = decode_body(await request.read(), ModelRequest)
    manager = request.app[MANAGER]
    if manager.single:
        return manager.resolve(None)
    entry = manager.catalog.find(body.model)
    if entry is None:
        raise ApiError(404, f"model '{body.model}' not found", code="model_not_found", param="model")
    return manager.slots[entry.id]


async def load_model(request: web.Request) -> web.Response:
    await request.app[MANAGER].load(await _named_slot(request))
    return web.json_response({"success": True})


async def unload_model(request: web.Request) -> web.Response:
    await request.app[MANAGER].unload(await _named_slot(request))
    return web.json_response({"success": True})


async def sleep_model(request: web.Request) -> web.Response:
    await request.app[MANAGER].sleep(await _named_slot(request))
    return web.json_response({"success": True})


async def model_events(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
    })
    await response.prepare(request)
    subscription = manager.events.subscribe()
    encode = msgspec.json.encode
    try:
        # Tells the watcher its subscription is live (and proxies to flush).
        await response.write(b": connected\n\n")
        while True:
            try:
                event = await subscription.next(KEEPALIVE_SECONDS)
            except EOFError:
                break
            if event is None:
                await response.write(b": keep-alive\n\n")
            else:
                await response.write(b"data: " + encode(event) + b"\n\n")
    except ConnectionResetError:
        pass
    finally:
        subscription.close()
    return response
