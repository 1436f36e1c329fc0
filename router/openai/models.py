"""GET /v1/models and GET /v1/models/{id} for the OpenAI and Anthropic SDKs.

Both SDKs call the same paths; Anthropic's always sends `anthropic-version`,
which makes the route speak Anthropic (router/http/route_info.py,
`Route.header_apis`): its model object and list page, and its error
envelope for an unknown id (its `request-id` header comes from
router/http/request_id.py, which asks the same api_of). Everyone else gets OpenAI's shapes: the same
cards GET /models lists (router/http/models_api.py).

An id may be a model's id or one of its aliases. None of this loads, wakes
or counts as use of a model.
"""

from __future__ import annotations

import datetime
from typing import Any

from aiohttp import web

from router.errors import model_not_found
from router.http.errors import ApiError
from router.http.keys import MANAGER, STARTED
from router.http.models_api import list_models as list_cards
from router.http.models_api import model_card, public_id, reload_if_asked
from router.http.route_info import Api, api_of
from router.lifecycle import ModelManager, ModelSlot

# Anthropic's page size: 20 unless asked, at most 1000.
DEFAULT_PAGE = 20
MAX_PAGE = 1000
LIFECYCLES = ("active", "deprecated", "retired")


def _find(manager: ModelManager, name: str) -> ModelSlot:
    entry = manager.catalog.find(name)
    if entry is None:
        raise model_not_found(name)
    return manager.slots[entry.id]


def _rfc3339(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def anthropic_model(manager: ModelManager, slot: ModelSlot, created: int) -> dict[str, Any]:
    """Anthropic's model object. We know no release date: `created_at` is when
    this server started listing it."""
    name = public_id(manager, slot)
    body: dict[str, Any] = {"type": "model", "id": name, "display_name": name,
                            "created_at": _rfc3339(created), "lifecycle": "active"}
    ready = slot.ready
    if ready is not None and slot.state.public in ("loaded", "sleeping"):
        # Prompt and output share the context; either may take all of it.
        body["max_input_tokens"] = body["max_tokens"] = ready.kv.max_context
    return body


def _limit(request: web.Request) -> int:
    text = request.query.get("limit")
    if text is None:
        return DEFAULT_PAGE
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise ApiError(400, f"limit: must be an integer from 1 to {MAX_PAGE}, got {text!r}",
                       param="limit", code="invalid_value")
    return limit


def _lifecycles(request: web.Request) -> set[str]:
    """?lifecycle=active,retired or repeated; unset: active and deprecated."""
    asked = {part.strip() for value in request.query.getall("lifecycle", [])
             for part in value.split(",") if part.strip()}
    unknown = asked - set(LIFECYCLES)
    if unknown:
        raise ApiError(400, f"lifecycle: unknown value(s) {sorted(unknown)}; "
                       f"expected {', '.join(LIFECYCLES)}", param="lifecycle", code="invalid_value")
    return asked or {"active", "deprecated"}


def _cursor(ids: list[str], request: web.Request, name: str) -> int | None:
    value = request.query.get(name)
    if value is None:
        return None
    if value not in ids:
        raise ApiError(400, f"{name}: no model '{value}' in this list", param=name,
                       code="invalid_value")
    return ids.index(value)


def anthropic_page(request: web.Request, models: list[dict[str, Any]]) -> dict[str, Any]:
    """One page of Anthropic's list: `limit` models after `after_id` or
    before `before_id` (the SDK pages with them), in catalog order."""
    limit = _limit(request)
    ids = [m["id"] for m in models]
    after = _cursor(ids, request, "after_id")
    before = _cursor(ids, request, "before_id")
    if after is not None and before is not None:
        raise ApiError(400, "give after_id or before_id, not both", param="before_id",
                       code="invalid_value")
    if before is not None:
        start = max(0, before - limit)
        page, has_more = models[start:before], start > 0
    else:
        start = 0 if after is None else after + 1
        page, has_more = models[start:start + limit], start + limit < len(models)
    return {"data": page, "has_more": has_more,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


async def list_models(request: web.Request) -> web.Response:
    if api_of(request) is not Api.ANTHROPIC:
        return await list_cards(request)
    await reload_if_asked(request)
    manager, created = request.app[MANAGER], request.app[STARTED]
    # Every model we serve is "active": a filter without it lists none.
    models = ([anthropic_model(manager, slot, created) for slot in manager.slots.values()]
              if "active" in _lifecycles(request) else [])
    return web.json_response(anthropic_page(request, models))


async def retrieve_model(request: web.Request) -> web.Response:
    manager, created = request.app[MANAGER], request.app[STARTED]
    slot = _find(manager, request.match_info["model_id"])
    if api_of(request) is Api.ANTHROPIC:
        return web.json_response(anthropic_model(manager, slot, created))
    return web.json_response(model_card(manager, slot, created))
