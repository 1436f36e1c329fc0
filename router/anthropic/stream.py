"""A streamed Message, in Anthropic's event lifecycle:

    message_start   the Message with empty content and its input usage
    ping
    content_block_start / content_block_delta... / content_block_stop   per block
    message_delta   stop_reason, stop_sequence and the final (cumulative) usage
    message_stop

Every event is `event: NAME` plus `data: {...}` whose type repeats NAME. An
engine failure after the stream opened becomes an `error` event that ends it.

message_start waits for the engine's first report on the prompt (a progress
report with SamplingParams.report_progress, else the first token), which
carries the prefix-cache hits, so its usage is already right; a failure before
then is still an ordinary HTTP error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from router.anthropic.blocks import ContentBlocks, WireEvent
from router.anthropic.reply import message, stop_reason, usage
from router.chat.events import ParsedEvent
from router.chat.turn import TurnRun
from router.engine_client import EngineFailure
from router.generation import PromptProgress
from router.http.errors import anthropic_error_body
from router.openai.common import engine_error

_encode = msgspec.json.encode


async def send_event(response: web.StreamResponse, name: str, data: dict[str, Any]) -> None:
    await response.write(b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n")


async def open_stream(request: web.Request, request_id: str) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        # Proxies such as nginx buffer responses unless told not to.
        "X-Accel-Buffering": "no",
        "request-id": request_id,
    })
    await response.prepare(request)
    return response


class MessageStream:
    def __init__(self, request: web.Request, run: TurnRun, blocks: ContentBlocks, *,
                 message_id: str, model: str, request_id: str):
        self.request = request
        self.run = run
        self.blocks = blocks
        self.message_id = message_id
        self.model = model
        self.request_id = request_id

    async def send(self) -> web.StreamResponse:
        run = self.run
        events = run.events()
        try:
            try:
                first = await anext(events, None)
            except EngineFailure as exc:
                raise engine_error(exc) from None
            response = await open_stream(self.request, self.request_id)
            try:
                await self._send_all(response, first, events)
            except ConnectionResetError:
                pass  # the client left; close() below aborts the engine request
            return response
        finally:
            run.generation.close()

    async def _send_all(self, response: web.StreamResponse, first: ParsedEvent | PromptProgress | None,
                        events: AsyncIterator[ParsedEvent | PromptProgress]) -> None:
        start = message(self.message_id, self.model, [], self.run, stop=None)
        await send_event(response, "message_start", {"type": "message_start", "message": start})
        await send_event(response, "ping", {"type": "ping"})
        try:
            if first is not None:
                await self._send_blocks(response, first)
            async for event in events:
                await self._send_blocks(response, event)
        except EngineFailure as exc:
            body = anthropic_error_body(engine_error(exc), self.request_id)
            await send_event(response, "error", {"type": "error", "error": body["error"]})
            return
        await self._write(response, self.blocks.finish())
        reason, sequence = stop_reason(self.run, self.blocks.has_tool_use)
        await send_event(response, "message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(self.run),
        })
        await send_event(response, "message_stop", {"type": "message_stop"})

    async def _send_blocks(self, response: web.StreamResponse, event: ParsedEvent | PromptProgress) -> None:
        if not isinstance(event, PromptProgress):
            await self._write(response, self.blocks.feed(event))

    @staticmethod
    async def _write(response: web.StreamResponse, wire: list[WireEvent]) -> None:
        for name, data in wire:
            await send_event(response, name, data)
