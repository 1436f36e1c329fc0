"""GET /props: llama.cpp's server properties.

A single-model server answers for its model. A router answers for itself
without `?model=` (llama.cpp's router answer, `role: "router"`) and for one
model with it. Either way the model is only resolved, never loaded or woken:
its context size comes from the engine's handshake when it is loaded or
asleep, else from its files, and reading them does not count as use.
"""

from __future__ import annotations

import importlib.metadata
from functools import cache
from typing import Any

from aiohttp import web

from router.http.errors import ApiError
from router.http.keys import MANAGER
from router.lifecycle import ModelManager, ModelSlot
from router.lifecycle.slot import ModelState
from router.llamacpp.params import completion_settings, generation_settings
from router.llamacpp.schemas import CompletionRequest
from router.sampling import build_params
from router.text.model_text import ModelText

# llama.cpp's placeholder for media in a multimodal prompt (mtmd_default_marker).
MEDIA_MARKER = "<__media__>"


@cache
def build_info() -> str:
    try:
        return f"roundhouse-{importlib.metadata.version('roundhouse')}"
    except importlib.metadata.PackageNotFoundError:
        return "roundhouse"


def n_ctx(slot: ModelSlot, text: ModelText) -> int:
    """The context a request gets: the engine's when it runs (or sleeps), else
    what it will be: --max-context, capped by the trained context."""
    if slot.ready is not None:
        return slot.ready.kv.max_context
    configured = slot.entry.settings.engine.max_context
    trained = text.context_length
    if configured and trained:
        return min(configured, trained)
    return configured or trained or 0


def default_params(manager: ModelManager, slot: ModelSlot, text: ModelText) -> dict[str, Any]:
    """What a /completion request that sets nothing would be sampled with."""
    req = CompletionRequest(prompt="")
    settings = completion_settings(req)
    params = build_params(settings.sampling, max_tokens=1, defaults=manager.sampling_defaults(slot),
                          eos_token_ids=text.eos_token_ids)
    return generation_settings(req, settings, params)


def model_props(manager: ModelManager, slot: ModelSlot, text: ModelText) -> dict[str, Any]:
    ready = slot.ready
    body: dict[str, Any] = {
        "default_generation_settings": {
            "id": 0,
            "id_task": -1,
            "n_ctx": n_ctx(slot, text),
            "speculative": False,
            "is_processing": slot.in_flight > 0,
            "params": default_params(manager, slot, text),
            "prompt": "",
            "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1,
                           "n_decoded": 0, "stopping_word": ""},
        },
        # Lanes: requests the engine decodes together.
        "total_slots": ready.kv.max_concurrency if ready else slot.entry.settings.engine.max_concurrency,
        "model_alias": slot.id,
        "model_path": str(slot.entry.path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": False,
        "endpoint_props": False,
        "endpoint_metrics": False,
        "ui": False,
        "ui_settings": {},
        "chat_template": text.template.source,
        "chat_template_caps": {},
        "bos_token": text.special_tokens.get("bos_token", ""),
        "eos_token": text.special_tokens.get("eos_token", ""),
        "build_info": build_info(),
        "is_sleeping": slot.state in (ModelState.SLEEPING, ModelState.SUSPENDING),
        "cors_proxy_enabled": False,
    }
    if text.template.tool_use_source is not None:
        body["chat_template_tool_use"] = text.template.tool_use_source
    return body


def router_props(manager: ModelManager) -> dict[str, Any]:
    """llama.cpp's router answer, placeholders included (its WebUI reads them)."""
    return {
        "role": "router",
        "max_instances": manager.config.models_max,
        "models_autoload": manager.config.autoload,
        "model_alias": "llama-server",
        "model_path": "none",
        "default_generation_settings": {"params": {}, "n_ctx": 0},
        "ui_settings": {},
        "build_info": build_info(),
        "cors_proxy_enabled": False,
    }


async def get_props(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    name = request.query.get("model")
    if not manager.single and not name:
        return web.json_response(router_props(manager))
    slot = manager.resolve(name)
    text = await manager.text_for(slot)
    return web.json_response(model_props(manager, slot, text))


async def post_props(request: web.Request) -> web.Response:
    # llama.cpp's answer when it was not started with --props.
    raise ApiError(501, "changing server properties is not supported", type="not_supported_error",
                   code="props_not_supported")
