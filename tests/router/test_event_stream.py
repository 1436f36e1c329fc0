"""Server-sent events as they go on the wire: EventStream's own chunk writes
send exactly what aiohttp's write would, an event's template encodes exactly
what its whole body would, and held events go out together, in order."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import TestServer

from router.http.sse import (
    TEXT_SLOT,
    EventStream,
    HeldEvents,
    data_event,
    open_event_stream,
    plain_chunk_writer,
    send_data,
    text_event_encoder,
)

# Small events, one past aiohttp's 2 KiB writelines threshold, and enough
# bytes in all to pass the 64 KiB after which writes drain.
EVENTS = [b"data: {\"n\": %d}\n\n" % i for i in range(40)] + [b"data: " + b"x" * 3000 + b"\n\n"] * 30


def raw_response(port: int, request_line: str) -> tuple[bytes, bytes]:
    """(headers, body) of one request, read until the server closes."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"{request_line}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    headers, _, body = data.partition(b"\r\n\r\n")
    return headers, body


def serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
          request_line: str) -> tuple[bytes, bytes]:
    async def main() -> tuple[bytes, bytes]:
        app = web.Application()
        app.router.add_get("/", handler)
        async with TestServer(app) as server:
            return await asyncio.to_thread(raw_response, server.port, request_line)  # type: ignore[arg-type]

    return asyncio.run(main())


def count_aiohttp_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = StreamWriter.write

    async def counted(self: StreamWriter, chunk: Any, **kwargs: Any) -> None:
        calls.append(len(chunk))
        await original(self, chunk, **kwargs)

    monkeypatch.setattr(StreamWriter, "write", counted)
    return calls


async def with_event_stream(request: web.Request) -> web.StreamResponse:
    response = await open_event_stream(request)
    for event in EVENTS:
        await response.write(event)
    await response.write_eof()
    assert response.body_length == len_on_wire(EVENTS, chunked=request.version >= (1, 1))
    return response


async def with_aiohttp(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    for event in EVENTS:
        await response.write(event)
    await response.write_eof()
    return response


def len_on_wire(events: list[bytes], *, chunked: bool) -> int:
    if not chunked:
        return sum(map(len, events))
    return sum(len(b"%x\r\n%b\r\n" % (len(e), e)) for e in events) + len(b"0\r\n\r\n")


def test_direct_chunks_are_the_bytes_aiohttp_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_aiohttp_writes(monkeypatch)
    headers, body = serve(with_event_stream, "GET / HTTP/1.1")
    assert b"Transfer-Encoding: chunked" in headers
    # Only the first event (which carries the headers out) took aiohttp's path.
    assert calls == [len(EVENTS[0])]
    _, reference = serve(with_aiohttp, "GET / HTTP/1.1")
    assert body == reference
    assert body.endswith(b"0\r\n\r\n")


def test_an_aiohttp_without_body_write_callbacks_still_writes_directly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp before on_body_write (the H200 machine's) once made every
    streamed answer a 500: the writer has no such attribute there."""
    writer = StreamWriter(SimpleNamespace(transport=None), asyncio.new_event_loop())  # type: ignore[arg-type]
    writer.enable_chunking()
    response = web.StreamResponse()
    assert plain_chunk_writer(writer, response) is writer
    del writer.on_body_write
    monkeypatch.delattr(AbstractStreamWriter, "on_body_write")
    assert plain_chunk_writer(writer, response) is writer
    writer.on_body_write = lambda chunk: None  # type: ignore[assignment]
    assert plain_chunk_writer(writer, response) is None


def test_an_http_1_0_client_gets_aiohttps_plain_body(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_aiohttp_writes(monkeypatch)
    headers, body = serve(with_event_stream, "GET / HTTP/1.0")
    assert b"chunked" not in headers
    assert body == b"".join(EVENTS)
    assert len(calls) == len(EVENTS)


def test_held_events_go_out_in_one_write_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_aiohttp_writes(monkeypatch)

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        held = HeldEvents(response)
        assert not held
        await held.send()  # nothing held: nothing written
        for event in EVENTS[:3]:
            held.add(event)
        assert held
        await held.send()
        assert not held
        held.add(EVENTS[3])
        await held.send()
        await response.write_eof()
        return response

    _, body = serve(handler, "GET / HTTP/1.1")
    first = b"".join(EVENTS[:3])
    assert calls[:2] == [len(first), len(EVENTS[3])]
    assert body == b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(first), first, len(EVENTS[3]),
                                                            EVENTS[3])


def test_the_keepalive_ticker_writes_through_the_same_path() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = await open_event_stream(request)
        assert isinstance(response, EventStream)
        await send_data(response, {"first": True})
        await response.write(response.keepalive)
        await response.write_eof()
        return response

    _, body = serve(handler, "GET / HTTP/1.1")
    first = data_event({"first": True})
    assert body == b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(first), first, len(b": keep-alive\n\n"),
                                                            b": keep-alive\n\n")


@pytest.mark.parametrize("text", ["", "plain", "quote \" and \\ backslash", "new\nline\t",
                                  "ünïcödé 東京 🦙", "\x00\x1f control", "</script>"])
def test_a_text_event_is_what_encoding_its_whole_body_gives(text: str) -> None:
    def body(piece: str) -> dict[str, Any]:
        return {"id": "cmpl-1", "created": 7, "choices": [{"text": piece, "index": 0,
                                                          "logprobs": None}], "usage": None}

    encode = text_event_encoder(body)
    assert encode(text) == b"data: " + msgspec.json.encode(body(text)) + b"\n\n"


def test_a_body_that_holds_the_slot_elsewhere_is_encoded_whole() -> None:
    def body(piece: str) -> dict[str, Any]:
        return {"model": TEXT_SLOT, "text": piece}

    encode = text_event_encoder(body)
    assert encode("hi") == data_event(body("hi"))

    def twice(piece: str) -> dict[str, Any]:
        return {"a": piece, "b": piece}

    assert text_event_encoder(twice)("hi") == data_event(twice("hi"))


def test_writes_now_are_the_bytes_write_sends_until_a_drain_is_due() -> None:
    seen: dict[str, Any] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        response = await open_event_stream(request)
        assert isinstance(response, EventStream)
        seen["before_first_write"] = response.can_write_now()  # headers not out yet
        await response.write(EVENTS[0])
        now = []
        for event in EVENTS[1:]:
            now.append(response.can_write_now())
            if now[-1]:
                response.write_now(event)
            else:
                await response.write(event)  # drains, as write() does every 64 KiB
        seen["now"] = now
        await response.write_eof()
        seen["after_eof"] = response.can_write_now()
        return response

    _, body = serve(handler, "GET / HTTP/1.1")
    _, reference = serve(with_aiohttp, "GET / HTTP/1.1")
    assert body == reference
    assert seen["before_first_write"] is False and seen["after_eof"] is False
    # Once past 64 KiB one write waits for its drain, and then writes go on at once.
    assert seen["now"].count(False) == 1 and seen["now"][-1]


def test_an_http_1_0_response_never_writes_now() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = await open_event_stream(request)
        assert isinstance(response, EventStream)
        await response.write(EVENTS[0])
        assert not response.can_write_now()
        await response.write_eof()
        return response

    _, body = serve(handler, "GET / HTTP/1.0")
    assert body == EVENTS[0]
