"""POST /v1/chat/completions/input_tokens (and /chat/completions/input_tokens):
the size of a chat request's prompt, without generating.

llama.cpp's answer, `{"object": "response.input_tokens", "input_tokens": N}`,
the shape of Responses' input_tokens. The prompt is the one
/v1/chat/completions would submit for the same body (template, tools,
thinking switch and all), built from the model's tokenizer and template
alone: the model is neither loaded nor woken.
"""

from __future__ import annotations

from aiohttp import web

from router.chat.turn import prepare_turn
from router.http.errors import decode_body
from router.http.keys import IMAGES, MANAGER
from router.openai.chat_request import chat_request
from router.openai.schemas import ChatCompletionRequest


async def count_chat_tokens(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), ChatCompletionRequest)
    chat = chat_request(req)
    manager = request.app[MANAGER]
    prepared = await prepare_turn(manager, manager.resolve(req.model), chat, request.app[IMAGES])
    return web.json_response({"object": "response.input_tokens",
                              "input_tokens": len(prepared.prompt_ids)})
