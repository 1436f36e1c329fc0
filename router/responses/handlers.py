"""The Responses API's HTTP handlers.

    POST   /v1/responses                         create (streamed or not)
    GET    /v1/responses/{id}                    a stored response
    DELETE /v1/responses/{id}                    forget it
    GET    /v1/responses/{id}/input_items        its input items, paginated
    POST   /v1/responses/{id}/cancel             only background responses can be (none here)
    POST   /v1/responses/input_tokens            count a request's input; never loads the model
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from router.chat.request import ChatRequest
from router.chat.turn import PreparedTurn, prepare_turn, start_turn
from router.engine_client import EngineFailure
from router.errors import RouterError
from router.http.errors import ApiError, decode_body, engine_error, invalid
from router.http.keys import IMAGES, MANAGER
from router.http.sse import StreamOpenedError
from router.lifecycle import ModelSlot
from router.openai.common import autoload
from router.responses import ids
from router.responses.generate import ResponseRun
from router.responses.pagination import page_of_items
from router.responses.request_map import ResponsePlan, build_plan
from router.responses.schema import ResponsesRequest
from router.responses.store import ChainPin, ResponseStore, StoredResponse, response_store
from router.responses.stream import stream_response, streaming_lease


@contextlib.contextmanager
def _about_input() -> Iterator[None]:
    """The shared turn layer names Chat Completions' `messages` in its errors
    (a template that refuses them, a prompt too long); here they are `input`."""
    try:
        yield
    except RouterError as error:
        if error.param == "messages":
            error.param = "input"
        raise


async def _prepare(request: web.Request, req: ResponsesRequest, chat: ChatRequest) -> PreparedTurn:
    manager = request.app[MANAGER]
    with _about_input():
        return await prepare_turn(manager, manager.resolve(req.model), chat, request.app[IMAGES])


async def create_response(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), ResponsesRequest)
    store = response_store(request.app)
    plan = build_plan(req, store)
    # Pinned with no await since build_plan read the chain, so it is the same
    # chain. A DELETE of one of its records while this runs fails this
    # response (store.py says why) rather than leaving it unable to continue.
    with store.pinned(req.previous_response_id) as pin:
        return await _create(request, req, plan, store, pin)


async def _create(request: web.Request, req: ResponsesRequest, plan: ResponsePlan,
                  store: ResponseStore, pin: ChainPin) -> web.StreamResponse:
    manager = request.app[MANAGER]
    prepared = await _prepare(request, req, plan.chat)
    slot = prepared.slot
    defaults = manager.sampling_defaults(slot)
    sampling = {
        "temperature": req.temperature if req.temperature is not None else defaults.temperature,
        "top_p": req.top_p if req.top_p is not None else defaults.top_p,
    }
    response_id = ids.new_id(ids.RESPONSE)

    def admit(loaded: ModelSlot) -> None:
        prepared.admit(loaded, param="input", limit_field="max_output_tokens")

    lease = manager.lease(slot, autoload=autoload(request), on_admit=admit)
    if plan.stream:
        lease = streaming_lease(request, lease)
    try:
        async with lease as engine:
            with _about_input():
                turn = start_turn(manager, prepared, engine, response_id)
            run = ResponseRun(response_id, plan, turn, slot.id, sampling, pin)
            if plan.stream:
                return await stream_response(request, run, store)
            try:
                async for _ in run.events():
                    pass
            except EngineFailure as exc:
                with _about_input():
                    raise engine_error(exc) from None
            finally:
                turn.generation.close()
    except StreamOpenedError as opened:
        return opened.response
    body = run.final_body()
    run.keep(body, store)
    return web.json_response(body)


def _stored(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    record = response_store(request.app).get(response_id)
    if record is None:
        raise ApiError(404, f"Response with id '{response_id}' not found.", type="invalid_request_error")
    return record


async def retrieve_response(request: web.Request) -> web.Response:
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raise invalid("streaming a stored response again is not supported; retrieve it whole",
                      "stream")
    return web.json_response(_stored(request).body)


async def delete_response(request: web.Request) -> web.Response:
    record = _stored(request)
    response_store(request.app).delete(record.id)
    return web.json_response({"id": record.id, "object": "response.deleted", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    _stored(request)
    raise invalid("Only responses created with background=true can be cancelled; this server "
                  "creates none.", None)


async def list_input_items(request: web.Request) -> web.Response:
    record = _stored(request)
    return web.json_response(page_of_items(record.input_items, request.query))


async def count_input_tokens(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), ResponsesRequest)
    plan = build_plan(req, response_store(request.app))
    # The tokenizer and template come from the model's files: nothing loads.
    prepared = await _prepare(request, req, plan.chat)
    body: dict[str, Any] = {"object": "response.input_tokens", "input_tokens": len(prepared.prompt_ids)}
    return web.json_response(body)
