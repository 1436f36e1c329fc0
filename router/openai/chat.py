"""POST /v1/chat/completions: tools, reasoning and timings included."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from router.build_info import build_fingerprint
from router.chat.events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallStart,
)
from router.chat.turn import TurnRun, prepare_turn, start_turn
from router.engine_client import EngineFailure
from router.generation import Piece, PromptProgress, new_request_id
from router.http.errors import decode_body, engine_error, openai_error_body
from router.http.keys import MANAGER
from router.http.sse import (
    HeldEvents,
    StreamOpenedError,
    data_event,
    open_event_stream,
    send_data,
    send_done,
    text_event_encoder,
)
from router.openai.chat_request import chat_request
from router.openai.common import autoload, now, streaming_lease, wants_usage
from router.openai.schemas import ChatCompletionRequest


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), ChatCompletionRequest)
    chat = chat_request(req)
    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    prepared = await prepare_turn(manager, slot, chat)
    lease = manager.lease(slot, autoload=autoload(request), on_admit=prepared.admit)
    if req.stream:
        lease = streaming_lease(request, lease)
    try:
        async with lease as engine:
            run = start_turn(manager, prepared, engine, new_request_id("chatcmpl"))
            if req.stream:
                stream = ChatStream(request, run, slot.id, wants_usage(req),
                                    timings_per_token=bool(req.timings_per_token))
                return await stream.send()
            try:
                await run.run_to_end()
            except EngineFailure as exc:
                raise engine_error(exc) from None
    except StreamOpenedError as opened:
        return opened.response
    return web.json_response(completion_body(run, slot.id))


def _message(run: TurnRun) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": run.content or None}
    if run.content == "" and not run.tool_calls:
        message["content"] = ""
    if run.reasoning:
        message["reasoning_content"] = run.reasoning
    if run.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in run.tool_calls
        ]
    return message


def completion_body(run: TurnRun, model: str) -> dict[str, Any]:
    return {
        "id": run.generation.request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": build_fingerprint(),
        "choices": [{
            "index": 0,
            "message": _message(run),
            "logprobs": None,
            "finish_reason": run.finish_reason,
        }],
        "usage": run.usage(),
        "timings": run.generation.timings(),
    }


class ChatStream:
    """Server-sent chunks as OpenAI streams them: a role chunk, deltas of
    reasoning_content, content and tool_calls (a delta with the call's id and
    name, then pieces of its arguments), a finish chunk (with llama.cpp's
    timings), the usage chunk when asked for, then [DONE]."""

    def __init__(self, request: web.Request, run: TurnRun, model: str, include_usage: bool, *,
                 timings_per_token: bool = False):
        self.request = request
        self.run = run
        self.model = model
        self.include_usage = include_usage
        # llama.cpp's web UI asks for timings on every content chunk.
        self.timings_per_token = timings_per_token
        self.created = now()
        self.started = time.perf_counter()
        # The events of most chunks (text deltas), each encoded once as a template.
        self._content_event = text_event_encoder(lambda text: self.chunk({"content": text}))
        self._reasoning_event = text_event_encoder(
            lambda text: self.chunk({"reasoning_content": text}))

    def chunk(self, delta: dict[str, Any] | None, finish_reason: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.run.generation.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": build_fingerprint(),
            "choices": [] if delta is None else [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def delta(self, event: object) -> dict[str, Any] | None:
        if isinstance(event, ContentDelta):
            # Never an empty content delta: the role chunk opened the message.
            return {"content": event.text} if event.text else None
        if isinstance(event, ReasoningDelta):
            return {"reasoning_content": event.text}
        if isinstance(event, ToolCallStart):
            return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        if isinstance(event, ToolCallDelta):
            return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
        return None  # ToolCallEnd: nothing new to send

    def progress(self, progress: PromptProgress) -> dict[str, Any]:
        body = self.chunk(None)
        body["prompt_progress"] = {
            "total": progress.total, "cache": progress.cached, "processed": progress.processed,
            "time_ms": (time.perf_counter() - self.started) * 1000,
        }
        return body

    def event_data(self, event: object) -> bytes | None:
        """The data event that a turn event sends, or None when it sends nothing."""
        if isinstance(event, PromptProgress):
            return data_event(self.progress(event))
        if not self.timings_per_token:
            # Text deltas, most chunks, from their templates (what delta() and chunk() make).
            if isinstance(event, ContentDelta):
                return self._content_event(event.text) if event.text else None
            if isinstance(event, ReasoningDelta):
                return self._reasoning_event(event.text)
        delta = self.delta(event)
        if delta is None:
            return None
        body = self.chunk(delta)
        if self.timings_per_token:
            body["timings"] = self.run.generation.timings()
        return data_event(body)

    async def send(self) -> web.StreamResponse:
        response = await open_event_stream(self.request)
        run = self.run
        try:
            # llama.cpp's opening chunk: the role, content null.
            await send_data(response, self.chunk({"role": "assistant", "content": None}))

            def send_now(item: Piece | PromptProgress) -> None:
                for event in run.events_of(item):
                    data = self.event_data(event)
                    if data is not None:
                        response.write_now(data)

            # While the response takes writes at once, the engine reader's
            # pass sends the events (Generation.push_items); the loop below
            # sends the others.
            run.generation.push_items(response.can_write_now, send_now)
            held = HeldEvents(response)
            try:
                async for event in run.events():
                    data = self.event_data(event)
                    if data is not None:
                        held.add(data)
                    if held and not run.generation.output_waiting:
                        await held.send()
            except EngineFailure as exc:
                await held.send()
                await send_data(response, openai_error_body(engine_error(exc)))
            else:
                await held.send()
                final = self.chunk({}, run.finish_reason)
                final["timings"] = run.generation.timings()
                await send_data(response, final)
                if self.include_usage:
                    usage = self.chunk(None)
                    usage["usage"] = run.usage()
                    await send_data(response, usage)
            await send_done(response)
        except ConnectionResetError:
            pass  # the client left; close() below aborts the engine request
        finally:
            run.generation.close()
        return response
