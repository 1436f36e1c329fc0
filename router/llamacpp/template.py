"""POST /apply-template: the prompt /v1/chat/completions would send for the
same body, rendered with the model's chat template without loading the model.

The body is read exactly as Chat Completions reads it (messages, tools,
tool_choice, chat_template_kwargs, enable_thinking, ...), so the two always agree.
Images are not loaded: each stands as the one image token the template writes.
"""

from __future__ import annotations

from aiohttp import web

from router.chat.turn import render_turn
from router.http.errors import decode_body
from router.http.keys import MANAGER
from router.openai.chat_request import chat_request
from router.openai.schemas import ChatCompletionRequest


async def apply_template(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), ChatCompletionRequest)
    chat = chat_request(req)
    manager = request.app[MANAGER]
    prepared = await render_turn(manager, manager.resolve(req.model), chat)
    return web.json_response({"prompt": prepared.prompt})
