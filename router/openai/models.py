"""GET /v1/models: every catalog model, with its lifecycle state."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.lifecycle import ModelSlot
from router.openai.common import MANAGER

STARTED = web.AppKey("started", int)


def model_card(slot: ModelSlot, created: int) -> dict[str, Any]:
    status: dict[str, Any] = {"value": slot.state.value}
    if slot.failed:
        status["failed"] = True
        status["error"] = slot.error
    if slot.state.value == "loading":
        status["progress"] = round(slot.progress, 3)
    card: dict[str, Any] = {
        "id": slot.id,
        "object": "model",
        "created": created,
        "owned_by": "roundhouse",
        "path": str(slot.entry.path),
        "status": status,
    }
    if slot.ready is not None:
        facts = slot.ready.model
        card["max_model_len"] = slot.ready.kv.max_context
        card["meta"] = {
            "n_vocab": facts.n_vocab,
            "n_ctx": slot.ready.kv.max_context,
            "n_ctx_train": facts.n_ctx_train,
            "n_embd": facts.n_embd,
            "n_params": facts.n_params,
            "size": facts.size_bytes,
        }
    return card


async def list_models(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    created = request.app[STARTED]
    return web.json_response({
        "object": "list",
        "data": [model_card(slot, created) for slot in manager.slots.values()],
    })
