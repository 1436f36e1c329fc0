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
then is still an ordinary HTTP error. Unless that wait (or the one for a
lane) passes router/http/sse.py's OPEN_AFTER: then the stream opens and
`ping` events keep it alive until message_start (the SDKs skip pings), and
a failure is an `error` event.
"""

from __future__ import annotations

import asyncio
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
from router.http.errors import anthropic_error_body, as_api_error, engine_error
from router.http.sse import (
    ANTHROPIC_PING,
    OPEN_AFTER,
    EventStream,
    StreamingLease,
    open_event_stream,
    stream_of,
)
from router.observability.records import current_record

_encode = msgspec.json.encode


async def send_event(response: web.StreamResponse, name: str, data: dict[str, Any]) -> None:
    await response.write(b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n")


async def open_stream(request: web.Request, request_id: str) -> EventStream:
    return await open_event_stream(request, headers={"request-id": request_id},
                                   keepalive=ANTHROPIC_PING)


async def send_error(response: web.StreamResponse, exc: Exception, request_id: str) -> None:
    """A failure after the stream opened: Anthropic's `error` event."""
    error = as_api_error(exc)
    record = current_record.get()
    if record is not None:
        record.outcome, record.error_code = "error", error.code
    body = anthropic_error_body(error, request_id)
    await send_event(response, "error", {"type": "error", "error": body["error"]})


def streaming_lease(request: web.Request, lease: Any, request_id: str) -> Any:
    """A streamed message's lease: the stream opens (pinged) when admission
    takes a while; a refusal then is an `error` event."""
    return StreamingLease(lease, lambda: open_stream(request, request_id),
                          lambda response, exc: send_error(response, exc, request_id))


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
        first_event = asyncio.ensure_future(anext(events, None))
        try:
            response = stream_of(self.request)
            if response is None:
                await asyncio.wait({first_event}, timeout=OPEN_AFTER)
                if first_event.done() and isinstance(first_event.exception(), EngineFailure):
                    raise engine_error(first_event.exception()) from None  # type: ignore[arg-type]
                response = await open_stream(self.request, self.request_id)
            try:
                try:
                    first = await first_event
                except EngineFailure as exc:
                    await send_error(response, exc, self.request_id)
                    return response
                await self._send_all(response, first, events)
            except ConnectionResetError:
                pass  # the client left; close() below aborts the engine request
            return response
        finally:
            if not first_event.done():
                first_event.cancel()
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
