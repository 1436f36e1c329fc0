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
from aiohttp.http_writer import StreamWriter

from router.env import sse_keepalive_seconds

_encode = msgspec.json.encode

KEEPALIVE = sse_keepalive_seconds()
OPEN_AFTER = min(2.5, KEEPALIVE)
COMMENT = b": keep-alive\n\n"
ANTHROPIC_PING = b'event: ping\ndata: {"type": "ping"}\n\n'

T = TypeVar("T")


# aiohttp's StreamWriter.write drains after this many bytes written (its LIMIT).
DRAIN_EVERY = 0x10000


def plain_chunk_writer(writer: Any, response: web.StreamResponse) -> StreamWriter | None:
    """The response's writer when its body is plain HTTP/1.1 chunks (no
    compression, no declared length, no write callbacks), which EventStream
    may then write to the transport itself; else None. Every aiohttp from
    the oldest we accept (3.9, without on_body_write) counts its writes in
    buffer_size and output_size."""
    if (type(writer) is StreamWriter and writer.chunked and writer.length is None
            and not response.compression and getattr(writer, "on_body_write", None) is None
            and getattr(writer, "_on_chunk_sent", None) is None
            and hasattr(writer, "buffer_size") and hasattr(writer, "output_size")):
        return writer
    return None


class EventStream(web.StreamResponse):
    """A text/event-stream response that notes when it last wrote, and sends
    `keepalive` whenever it has been silent for KEEPALIVE seconds.

    A streamed answer writes one event per token, tens of thousands a second
    under load, and aiohttp's write path costs three coroutines and Python
    framing for each. So once the headers are out, writes to a plain chunked
    body go straight to the transport as the same bytes aiohttp would send
    (`<size in hex>\\r\\n<data>\\r\\n`), with the writer's counters kept and
    drains where aiohttp's write would drain; anything else goes through
    aiohttp. Such a write needs no coroutine at all while no drain is due
    (can_write_now, write_now): the engine reader's pass writes events so."""

    def __init__(self, *, headers: dict[str, str], keepalive: bytes):
        super().__init__(status=200, headers=headers)
        self.keepalive = keepalive
        self.last_write = time.monotonic()
        self._ticker: asyncio.Task[None] | None = None
        # The writer when its chunks may be written directly (plain_chunk_writer) ...
        self._plain: StreamWriter | None = None
        # ... and once they may: after the first write (the headers go out with it).
        self._direct: StreamWriter | None = None

    async def prepare(self, request: web.BaseRequest) -> Any:
        writer = await super().prepare(request)
        self.last_write = time.monotonic()
        self._ticker = asyncio.create_task(self._tick())
        self._plain = plain_chunk_writer(writer, self)
        return writer

    async def write(self, data: Any) -> None:
        self.last_write = time.monotonic()
        writer = self._direct
        if writer is not None and type(data) is bytes and data:
            transport = writer.transport
            # A closing transport is left to aiohttp, which raises its error.
            if transport is not None and not transport.is_closing():
                self._write_chunk(writer, transport, data)
                if writer.buffer_size > DRAIN_EVERY:
                    writer.buffer_size = 0
                    await writer.drain()
                return
        await super().write(data)
        if data:
            self._direct = self._plain

    def can_write_now(self) -> bool:
        """Whether write_now may write: write() would neither wait (no drain
        due) nor leave the write to aiohttp (plain chunks, headers out,
        transport open)."""
        writer = self._direct
        if writer is None or writer.buffer_size > DRAIN_EVERY:
            return False
        transport = writer.transport
        return transport is not None and not transport.is_closing()

    def write_now(self, data: bytes) -> None:
        """write(data) without waiting, where can_write_now() said so (in the
        same pass: nothing can change it in between). A drain that falls due
        is left to the next write()."""
        writer = self._direct
        assert writer is not None
        transport = writer.transport
        # Closed by an earlier write of this pass: the client has gone, as
        # the handler learns at its next write().
        if data and transport is not None and not transport.is_closing():
            self.last_write = time.monotonic()
            self._write_chunk(writer, transport, data)

    @staticmethod
    def _write_chunk(writer: StreamWriter, transport: Any, data: bytes) -> None:
        """data as one chunk, counted as aiohttp counts what it writes."""
        chunk = b"%x\r\n%b\r\n" % (len(data), data)
        writer.buffer_size += len(chunk)
        writer.output_size += len(chunk)
        transport.write(chunk)

    async def write_eof(self, data: bytes = b"") -> None:
        self.stop_keepalive()
        self._direct = self._plain = None
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


def data_event(payload: Any) -> bytes:
    """The bytes of a data event carrying payload as JSON."""
    return b"data: " + _encode(payload) + b"\n\n"


# Stands for the text in a body that text_event_encoder encodes once. No real
# body holds it (NULs are not in ids, model names or field names); one that
# did would be encoded whole for each event instead.
TEXT_SLOT = "\x00roundhouse-text\x00"


def text_event_encoder(body_with: Callable[[str], Any]) -> Callable[[str], bytes]:
    """text -> the bytes of the data event whose JSON body is body_with(text),
    byte for byte what send_data writes. A streamed answer sends one such
    event per piece of text with all else fixed, so the body is encoded once
    with TEXT_SLOT in the text's place, and each event costs one string
    encode and a join instead of building and encoding the whole body."""
    encoded = data_event(body_with(TEXT_SLOT))
    slot = _encode(TEXT_SLOT)
    head, found, tail = encoded.partition(slot)
    if not found or slot in tail:
        return lambda text: data_event(body_with(text))
    return lambda text: b"".join((head, _encode(text), tail))


class HeldEvents:
    """Events of one stream held to be sent together.

    A stream whose handler fell behind its engine finds several steps'
    outputs waiting at once; it holds their events while more are at hand
    (Generation.output_waiting) and sends them in one write: one chunk and
    one system call instead of one per event, the same bytes, and nothing
    held past the moment it would have been sent, as the handler does not
    wait in between."""

    __slots__ = ("_events", "_response")

    def __init__(self, response: web.StreamResponse):
        self._response = response
        self._events: list[bytes] = []

    def __bool__(self) -> bool:
        return bool(self._events)

    def add(self, event: bytes) -> None:
        self._events.append(event)

    async def send(self) -> None:
        """Write what is held, if anything, in one write."""
        events = self._events
        if events:
            data = events[0] if len(events) == 1 else b"".join(events)
            events.clear()
            await self._response.write(data)


async def send_data(response: web.StreamResponse, payload: Any) -> None:
    await response.write(data_event(payload))


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
