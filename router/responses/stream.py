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
from router.http.errors import api_error, as_api_error, engine_error
from router.http.sse import EventStream, StreamingLease, open_event_stream
from router.observability.records import current_record
from router.responses.generate import ResponseRun
from router.responses.store import ChainBroken, ResponseStore

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


async def send_error(response: EventStream, exc: Exception) -> None:
    """A refusal after the stream opened (a long wait for admission): the
    API's `error` event, which ends the stream."""
    error = as_api_error(exc)
    record = current_record.get()
    if record is not None:
        record.outcome, record.error_code = "error", error.code
    await EventWriter(response).send({"type": "error", "code": error.code or error.type,
                                      "message": error.message, "param": error.param})


def streaming_lease(request: web.Request, lease: Any) -> Any:
    """A streamed response's lease: the stream opens (with keep-alive
    comments) when admission takes a while; a refusal then is an error event."""
    return StreamingLease(lease, lambda: open_event_stream(request), send_error)


async def stream_response(request: web.Request, run: ResponseRun, store: ResponseStore) -> web.StreamResponse:
    response = await open_event_stream(request)
    writer = EventWriter(response)
    try:
        await writer.send({"type": "response.created", "response": run.body("in_progress")})
        await writer.send({"type": "response.in_progress", "response": run.body("in_progress")})
        try:
            async for event in run.events():
                await writer.send(event)
            body = run.final_body()
            # Stored before the client hears of the end, so that it can
            # continue the conversation at once.
            run.keep(body, store)
        except EngineFailure as exc:
            await writer.send({"type": "response.failed",
                               "response": run.body("failed", engine_error(exc))})
        except ChainBroken as broken:
            await writer.send({"type": "response.failed", "response": run.body("failed", api_error(broken))})
        else:
            await writer.send({"type": f"response.{body['status']}", "response": body})
    except ConnectionResetError:
        pass  # the client left; close() below aborts the engine request
    finally:
        run.run.generation.close()
    return response
