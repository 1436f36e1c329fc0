"""Server-sent events for streamed responses."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_encode = msgspec.json.encode


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            # Proxies such as nginx buffer responses unless told not to.
            "X-Accel-Buffering": "no",
        },
    )
    await response.prepare(request)
    return response


async def send_data(response: web.StreamResponse, payload: Any) -> None:
    await response.write(b"data: " + _encode(payload) + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
