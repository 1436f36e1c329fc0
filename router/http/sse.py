"""Server-sent events for streamed responses, kept alive while they are quiet.

Proxies and clients drop a stream that sends nothing for a while, and a
stream can be quiet for long: waiting for a lane, or for a long prompt's
prefill. So:

- an open stream sends its API's keep-alive (`: keep-alive` comment lines on
  OpenAI, Responses and llama.cpp streams; Anthropic's `event: ping`)
  whenever nothing went out for KEEPALIVE seconds (ROUNDHOUSE_SSE_KEEPALIVE,
  default 5);
- a streamed request still waiting for admission after OPEN_AFTER seconds
  gets its headers (200) and keep-alives while it waits (StreamingLease); a
  refusal after that is the API's error event instead of an HTTP status.

open_event_stream() opens a request's stream once: a handler that finds it
already open (by the wait) writes on to the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Generic, TypeVar

import msgspec
from aiohttp import web

from router.env import sse_keepalive_seconds

_encode = msgspec.json.encode

KEEPALIVE = sse_keepalive_seconds()
OPEN_AFTER = min(2.5, KEEPALIVE)
COMMENT = b": keep-alive\n\n"
ANTHROPIC_PING = b'event: ping\ndata: {"type": "ping"}\n\n'

T = TypeVar("T")


class EventStream(web.StreamResponse):
    """A text/event-stream response that notes when it last wrote, and sends
    `keepalive` whenever it has been silent for KEEPALIVE seconds."""

    def __init__(self, *, headers: dict[str, str], keepalive: bytes):
        super().__init__(status=200, headers=headers)
        self.keepalive = keepalive
        self.last_write = time.monotonic()
        self._ticker: asyncio.Task[None] | None = None

    async def prepare(self, request: web.BaseRequest) -> Any:
        writer = await super().prepare(request)
        self.last_write = time.monotonic()
        self._ticker = asyncio.create_task(self._tick())
        return writer

    async def write(self, data: Any) -> None:
        self.last_write = time.monotonic()
        await super().write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        self.stop_keepalive()
        await super().write_eof(data)

    def stop_keepalive(self) -> None:
        if self._ticker is not None and self._ticker is not asyncio.current_task():
            self._ticker.cancel()
        self._ticker = None

    async def _tick(self) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError, asyncio.CancelledError):
            while True:
                wait = self.last_write + KEEPALIVE - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                await self.write(self.keepalive)


# The request's open event stream, once there is one.
_OPEN: web.RequestKey[EventStream] = web.RequestKey("event_stream", EventStream)


def stream_of(request: web.Request) -> EventStream | None:
    """The request's event stream if it is already open."""
    return request.get(_OPEN)


async def open_event_stream(request: web.Request, *, headers: dict[str, str] | None = None,
                            keepalive: bytes = COMMENT) -> EventStream:
    existing = stream_of(request)
    if existing is not None:
        return existing
    response = EventStream(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        # Proxies such as nginx buffer responses unless told not to.
        "X-Accel-Buffering": "no",
        **(headers or {}),
    }, keepalive=keepalive)
    await response.prepare(request)
    request[_OPEN] = response
    return response


class StreamOpenedError(Exception):
    """Admission failed after the stream had opened; the error event went out."""

    def __init__(self, response: EventStream):
        super().__init__("refused after the stream opened")
        self.response = response


class StreamingLease(Generic[T]):
    """Enter `lease` for a streamed answer. When admission takes longer than
    OPEN_AFTER, the stream is opened first (`open_stream`) and kept alive
    while it waits; an error then is written by `send_error` as the API's
    error event and StreamOpenedError is raised, which the handler answers
    by returning that response."""

    def __init__(self, lease: AbstractAsyncContextManager[T],
                 open_stream: Callable[[], Awaitable[EventStream]],
                 send_error: Callable[[EventStream, Exception], Awaitable[None]]):
        self._lease = lease
        self._open_stream = open_stream
        self._send_error = send_error

    async def __aenter__(self) -> T:
        entering = asyncio.ensure_future(self._lease.__aenter__())
        try:
            done, _ = await asyncio.wait({entering}, timeout=OPEN_AFTER)
            if done:
                return entering.result()
            response = await self._open_stream()
            try:
                return await asyncio.shield(entering)
            except Exception as exc:  # a refusal: the status line is gone, an event says it
                with contextlib.suppress(ConnectionError):
                    await self._send_error(response, exc)
                raise StreamOpenedError(response) from exc
        except BaseException:
            if not entering.done():
                entering.cancel()
                with contextlib.suppress(BaseException):
                    await entering
            raise

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        return await self._lease.__aexit__(kind, exc, tb)


async def send_data(response: web.StreamResponse, payload: Any) -> None:
    await response.write(b"data: " + _encode(payload) + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
