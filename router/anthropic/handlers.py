"""POST /v1/messages and POST /v1/messages/count_tokens.

Errors raised here are ApiErrors; the error middleware renders them in
Anthropic's envelope (with a request-id header, 503 as 529 overloaded_error)
because the paths start with /v1/messages. Successful answers carry a
request-id header too, as Anthropic's do.
"""

from __future__ import annotations

from aiohttp import web

from router.anthropic.blocks import ContentBlocks
from router.anthropic.reply import message, new_message_id, stop_reason
from router.anthropic.request import chat_request, messages_request
from router.anthropic.schemas import CountTokensRequest, MessagesRequest
from router.anthropic.stream import MessageStream, streaming_lease
from router.chat.turn import prepare_turn, start_turn
from router.engine_client import EngineFailure
from router.generation import PromptProgress
from router.http.errors import decode_body, engine_error
from router.http.keys import IMAGES, MANAGER
from router.http.request_id import request_id_of
from router.http.sse import StreamOpenedError
from router.openai.common import autoload


async def create_message(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), MessagesRequest)
    chat, thinking = messages_request(req)
    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    prepared = await prepare_turn(manager, slot, chat, request.app[IMAGES])
    message_id = new_message_id()
    request_id = request_id_of(request)
    blocks = ContentBlocks(show_thinking=thinking.show, one_tool_use=not chat.parallel_tool_calls)
    lease = manager.lease(slot, autoload=autoload(request),
                          on_admit=lambda loaded: prepared.admit(loaded, clamp=True))
    if req.stream:
        lease = streaming_lease(request, lease, request_id)
    try:
        async with lease as engine:
            run = start_turn(manager, prepared, engine, message_id)
            if req.stream:
                stream = MessageStream(request, run, blocks, message_id=message_id, model=slot.id,
                                       request_id=request_id)
                return await stream.send()
            try:
                async for event in run.events():
                    if not isinstance(event, PromptProgress):
                        blocks.feed(event)
            except EngineFailure as exc:
                raise engine_error(exc) from None
            finally:
                run.generation.close()
    except StreamOpenedError as opened:
        return opened.response
    blocks.finish()
    body = message(message_id, slot.id, blocks.blocks, run, stop=stop_reason(run, blocks.has_tool_use))
    return web.json_response(body, headers={"request-id": request_id})


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's size as /v1/messages would render it, from the model's
    tokenizer and template alone: the model is neither loaded nor woken."""
    req = decode_body(await request.read(), CountTokensRequest)
    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    prepared = await prepare_turn(manager, slot, chat_request(req), request.app[IMAGES])
    return web.json_response({"input_tokens": len(prepared.prompt_ids)},
                             headers={"request-id": request_id_of(request)})
