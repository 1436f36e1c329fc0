"""GET /props: llama.cpp's server properties.

A single-model server answers for its model. A router answers for itself
without `?model=` (llama.cpp's router answer, `role: "router"`) and for one
model with it. Either way the model is only resolved, never loaded or woken:
its context size comes from the engine's handshake when it is loaded or
asleep, else from its files, and reading them does not count as use.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.build_info import build_fingerprint
from router.capabilities import model_capabilities
from router.http.errors import ApiError
from router.http.keys import MANAGER
from router.http.models_api import public_id
from router.lifecycle import ModelManager, ModelSlot
from router.lifecycle.slot import ModelState
from router.llamacpp.params import DEFAULT_SEED, completion_settings, generation_settings
from router.llamacpp.prompt import MEDIA_MARKER
from router.llamacpp.schemas import CompletionRequest
from router.sampling import build_params
from router.text.model_text import ModelText


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
    body = generation_settings(req, settings, params)
    # The model's --seed, what a request that brings none is sampled with;
    # -1 (a random seed per request) reads as llama.cpp writes it.
    seed = manager.sampling_defaults(slot).seed
    body["seed"] = seed if seed >= 0 else DEFAULT_SEED
    return body


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
        "model_alias": public_id(manager, slot),
        "model_path": str(slot.entry.path),
        "modalities": {"vision": slot.entry.settings.engine.vision, "video": False, "audio": False},
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": slot.entry.settings.slots_endpoint,
        "endpoint_props": False,
        "endpoint_metrics": False,
        # llama.cpp sends both names: its older web UI reads webui_*, the newer ui_*.
        "ui": False,
        "webui": False,
        "ui_settings": {},
        "webui_settings": {},
        "chat_template": text.template.source,
        "chat_template_caps": {},
        "bos_token": text.special_tokens.get("bos_token", ""),
        "eos_token": text.special_tokens.get("eos_token", ""),
        "build_info": build_fingerprint(),
        "is_sleeping": slot.state in (ModelState.SLEEPING, ModelState.SUSPENDING),
        "cors_proxy_enabled": False,
        # Ours: available, cupy_missing (GPUs without CuPy) or no_gpu.
        "cuda_kernels": manager.cuda_kernels,
        # Ours: whether POST /rerank is served with this model (--reranking).
        "reranking": slot.entry.settings.reranking,
        # Ours: whether the model runs batch-invariant (--deterministic).
        "deterministic": slot.entry.settings.engine.deterministic,
        # Ours: what the model serves (router/capabilities.py).
        "capabilities": model_capabilities(slot.entry.settings),
    }
    if ready is not None:
        # Ours: every model serves /v1/embeddings and /embedding, pooled as
        # its engine chose at load (--pooling, the model's own, else last).
        body["embeddings"] = {"pooling": ready.model.pooling, "n_embd": ready.model.n_embd}
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
        "webui_settings": {},
        "build_info": build_fingerprint(),
        "cors_proxy_enabled": False,
        "cuda_kernels": manager.cuda_kernels,
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
