"""The model catalog over HTTP, as llama.cpp's router serves it.

GET /models (and /v1/models)    every model with its status; ?reload=1 rescans
                                (router/openai/models.py: /v1/models/{id}, Anthropic's shapes)
POST /models/load               {"model": ID}: start loading (or waking) it and answer at
                                once, as llama.cpp does; ?wait=1 answers when it is loaded
POST /models/unload             {"model": ID}: unload once its requests finish
POST /models/sleep              {"model": ID}: release its device memory (409 when busy)
POST, DELETE /models            llama.cpp's download / delete from its cache: 405 here
GET /models/sse                 one event per status change, load progress, keep-alives

None of these count as use of a model: they never reset its idle timers.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from router.capabilities import input_modalities, model_capabilities
from router.env import sse_keepalive_seconds
from router.errors import NotFound
from router.http.errors import ApiError, decode_body
from router.http.keys import MANAGER, STARTED
from router.lifecycle import ModelManager, ModelSlot
from router.lifecycle.reload import reload_catalog
from router.settings import ModelSettings
from router.supervisor import engine_args


class ModelRequest(msgspec.Struct):
    # Empty on a single-model server: the model. Required with --models-dir.
    model: str = ""


def modalities(settings: ModelSettings) -> dict[str, list[str]]:
    """Text in (and images with --vision), text out."""
    return {"input": input_modalities(settings), "output": ["text"]}


def architecture(settings: ModelSettings) -> dict[str, Any]:
    """OpenRouter's shape, what its clients read before offering images:
    modality "text->text", or "text+image->text" with --vision."""
    inputs = input_modalities(settings)
    return {"modality": "+".join(inputs) + "->text", "input_modalities": inputs,
            "output_modalities": ["text"]}


def public_id(manager: ModelManager, slot: ModelSlot) -> str:
    """The id clients see: on a single-model server started with --alias, the
    first alias (llama.cpp's `id` is its alias), else the catalog id."""
    aliases = slot.entry.settings.aliases
    return aliases[0] if manager.single and aliases else slot.id


def _status(slot: ModelSlot) -> dict[str, Any]:
    """llama.cpp's router status: value, args, and for a failed load `failed`
    with the engine's `exit_code` (ours add the `error` it printed)."""
    state = slot.state
    status: dict[str, Any] = {"value": state.public}
    if state.public != "unloaded" or slot.failed:
        # As the engine was started: on the planner's device, with its grant.
        status["args"] = engine_args(slot.engine.entry if slot.engine is not None else slot.entry)
    if slot.failed:
        status["failed"] = True
        status["error"] = slot.error
        if slot.exit_code is not None:
            status["exit_code"] = slot.exit_code
    if state.public == "loading":
        status["progress"] = {"value": round(slot.progress, 4)}
    return status


def device_memory(manager: ModelManager, slot: ModelSlot) -> dict[str, Any]:
    """Where the model runs and its device memory: `device` (cuda:N, cpu;
    null before its first placement), `planned_bytes` (what the planner
    counts for it: its grant's plan, or the estimate of a model not yet
    loaded; null when it is not planned by bytes) and `held` (what its
    engine reported holding, by kind, and the experts it keeps in host memory;
    null unless loaded or asleep)."""
    placement = slot.placement
    planned: int | None = None
    if placement is not None and placement.gpu is not None:
        planned = placement.planned_bytes
    elif placement is None:
        estimate = manager.needs.estimate(slot)
        planned = estimate.total_bytes if estimate is not None else None
    ready = slot.ready
    held = None
    if ready is not None and slot.state.public in ("loaded", "sleeping"):
        memory = ready.memory
        held = {"weights_bytes": memory.weights_bytes, "kv_bytes": memory.kv_bytes,
                "activation_bytes": memory.activation_bytes,
                "workspace_bytes": memory.workspace_bytes, "graph_bytes": memory.graph_bytes,
                "footprint_bytes": memory.footprint_bytes,
                "host_weights_bytes": memory.host_weights_bytes}
    device = placement.engine_device if placement is not None else None
    return {"device": device, "planned_bytes": planned, "held": held}


def model_card(manager: ModelManager, slot: ModelSlot, created: int) -> dict[str, Any]:
    settings = slot.entry.settings
    card: dict[str, Any] = {
        "id": public_id(manager, slot),
        "object": "model",
        "created": created,
        "owned_by": "roundhouse",
        # The catalog's own name for it (the file or directory name).
        "name": slot.id,
        "aliases": list(settings.aliases),
        "tags": list(settings.tags),
        "path": str(slot.entry.path),
        "modalities": modalities(settings),
        "architecture": architecture(settings),
        "capabilities": model_capabilities(settings),
        "status": _status(slot),
        "memory": device_memory(manager, slot),
    }
    ready = slot.ready
    if ready is not None and slot.state.public in ("loaded", "sleeping"):
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
            # How its embeddings pool (/v1/embeddings, /embedding): ours.
            "pooling": facts.pooling,
        }
    return card


def model_cards(manager: ModelManager, created: int) -> list[dict[str, Any]]:
    return [model_card(manager, slot, created) for slot in manager.slots.values()]


async def reload_if_asked(request: web.Request) -> None:
    """?reload=1 rescans the catalog first."""
    if request.query.get("reload", "0").lower() in ("1", "true", "yes"):
        try:
            await reload_catalog(request.app[MANAGER])
        except ValueError as exc:
            raise ApiError(400, f"reload failed, catalog unchanged: {exc}", code="reload_failed") from None


async def list_models(request: web.Request) -> web.Response:
    await reload_if_asked(request)
    cards = model_cards(request.app[MANAGER], request.app[STARTED])
    return web.json_response({"object": "list", "data": cards})


async def _named_slot(request: web.Request) -> ModelSlot:
    body = decode_body(await request.read(), ModelRequest)
    try:
        # A single-model server refuses a name that is not its model's (or an
        # alias): unloading "gpt-4" must not unload the only model.
        return request.app[MANAGER].named(body.model)
    except NotFound:
        raise ApiError(404, f"model '{body.model}' not found", code="model_not_found",
                       param="model") from None


def _truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


async def load_model(request: web.Request) -> web.Response:
    """Answers once the load has started (or the model is loaded), as
    llama.cpp's router does: clients poll GET /models or watch /models/sse,
    where a load that fails shows as status.failed. ?wait=1 answers when the
    model is loaded (503 model_load_failed when it cannot be)."""
    manager = request.app[MANAGER]
    slot = await _named_slot(request)
    if _truthy(request.query.get("wait", "0")):
        await manager.load(slot)
    else:
        await manager.begin_load(slot)
    return web.json_response({"success": True})


async def unload_model(request: web.Request) -> web.Response:
    await request.app[MANAGER].unload(await _named_slot(request))
    return web.json_response({"success": True})


async def sleep_model(request: web.Request) -> web.Response:
    await request.app[MANAGER].sleep(await _named_slot(request))
    return web.json_response({"success": True})


async def model_store(request: web.Request) -> web.Response:
    """POST /models and DELETE /models?model=: llama.cpp's router downloads a
    model into its cache and deletes one from it there. Roundhouse serves the
    files it is given (--models-dir, --models-preset) and fetches nothing, so
    both are refused; loading and unloading are /models/load and /models/unload."""
    raise ApiError(405, f"{request.method} /models (download into or delete from a model "
                   "cache) is not supported: Roundhouse serves the models in --models-dir and "
                   "--models-preset; POST /models/load and /models/unload load and unload them",
                   code="not_supported", headers={"Allow": "GET, HEAD"})


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
                # Keep-alive comments after this long idle, as every stream has them.
                event = await subscription.next(sse_keepalive_seconds())
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
