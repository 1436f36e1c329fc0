"""A response streamed as the API's semantic server-sent events.

    response.created, response.in_progress,
    the output events of router/responses/output.py,
    then exactly one of response.completed / response.incomplete /
    response.failed.

Each event is `event: <type>` plus `data: <json>` with a `sequence_number`
counting from 0; there is no `[DONE]` line, as OpenAI sends none. A client
that leaves aborts the engine request (the handler is cancelled, or the
write fails, and `close()` runs either way).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from router.engine_client import EngineFailure
from router.http.sse import open_event_stream
from router.openai.common import engine_error
from router.responses.generate import ResponseRun
from router.responses.store import ResponseStore

_encode = msgspec.json.encode


class EventWriter:
    def __init__(self, response: web.StreamResponse):
        self.response = response
        self.sequence_number = 0

    async def send(self, event: dict[str, Any]) -> None:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        kind = event["type"].encode()
        await self.response.write(b"event: " + kind + b"\ndata: " + _encode(event) + b"\n\n")


async def stream_response(request: web.Request, run: ResponseRun, store: ResponseStore) -> web.StreamResponse:
    response = await open_event_stream(request)
    writer = EventWriter(response)
    try:
        await writer.send({"type": "response.created", "response": run.body("in_progress")})
        await writer.send({"type": "response.in_progress", "response": run.body("in_progress")})
        try:
            async for event in run.events():
                await writer.send(event)
        except EngineFailure as exc:
            await writer.send({"type": "response.failed",
                               "response": run.body("failed", engine_error(exc))})
        else:
            body = run.final_body()
            # Stored before the client hears of the end, so that it can
            # continue the conversation at once.
            run.keep(body, store)
            await writer.send({"type": f"response.{body['status']}", "response": body})
    except ConnectionResetError:
        pass  # the client left; close() below aborts the engine request
    finally:
        run.run.generation.close()
    return response
