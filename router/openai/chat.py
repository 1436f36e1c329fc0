"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.generation import Generation, new_request_id
from router.http.errors import decode_body, invalid
from router.http.keys import MANAGER
from router.openai.common import (
    autoload,
    collect,
    now,
    start_generation,
    stream_generation,
    usage,
    wants_usage,
)
from router.openai.params import check_common, check_max_tokens
from router.openai.schemas import ChatCompletionRequest, ChatMessage
from router.text.chat_template import TemplateError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_content(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise invalid(f"messages[{index}] ({message.role}) has no content", f"messages[{index}].content")
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        kind = part.get("type")
        if kind != "text":
            raise invalid(f"content part type {kind!r} is not supported here; send text parts",
                          f"{where}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid("a text content part needs a string 'text'", f"{where}.text", "invalid_type")
        texts.append(text)
    return "\n".join(texts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise invalid("'messages' must hold at least one message", "messages")
    rendered = []
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise invalid(
                f"unknown role {message.role!r} in messages[{index}]; expected one of {', '.join(ROLES)}",
                f"messages[{index}].role",
            )
        entry: dict[str, Any] = {
            # OpenAI's "developer" is the system role of newer models.
            "role": "system" if message.role == "developer" else message.role,
            "content": _text_content(message, index),
        }
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        rendered.append(entry)
    return rendered


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), ChatCompletionRequest)
    check_common(req)
    if req.max_completion_tokens is not None:
        max_tokens, max_field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_field = req.max_tokens, "max_tokens"
    check_max_tokens(max_tokens, max_field)
    messages = template_messages(req.messages)

    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    text = await manager.text_for(slot)
    try:
        prompt = text.render_chat(
            messages, add_generation_prompt=req.add_generation_prompt, **(req.chat_template_kwargs or {})
        )
    except TemplateError as exc:
        raise invalid(f"the model's chat template rejected these messages: {exc}", "messages") from None
    prompt_ids = await text.encode_prompt_async(prompt)

    async with manager.lease(slot, autoload=autoload(request)) as engine:
        generation = start_generation(
            request.app, slot, engine, text, req, prompt_ids,
            new_request_id("chatcmpl"), max_tokens, max_field,
        )
        if req.stream:
            return await _stream(request, generation, slot.id, wants_usage(req))
        content = await collect(generation)
    return web.json_response({
        "id": generation.request_id,
        "object": "chat.completion",
        "created": now(),
        "model": slot.id,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "logprobs": None,
            "finish_reason": generation.finish_reason,
        }],
        "usage": usage(generation),
    })


async def _stream(
    request: web.Request, generation: Generation, model: str, include_usage: bool
) -> web.StreamResponse:
    created = now()

    def chunk(piece: str | None, finish_reason: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": generation.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "delta": {} if piece is None else {"content": piece},
                "logprobs": None,
                "finish_reason": finish_reason,
            }],
        }
        if include_usage:
            body["usage"] = None
        return body

    opening = chunk("", None)
    opening["choices"][0]["delta"]["role"] = "assistant"
    return await stream_generation(
        request, generation, chunk, opening=[opening], include_usage=include_usage
    )
