"""The middleware that gives every POST/DELETE request its RequestRecord and
tells the observers when it starts and ends (GETs are polling: /models,
/metrics, /health... are not requests to a model)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from router.http.keys import MANAGER
from router.http.request_id import OWN_ID, REQUEST_ID
from router.http.route_info import api_of
from router.observability.records import RECORD, RequestRecord, current_record

OBSERVED_METHODS = ("POST", "DELETE")


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return "error" if status >= 500 and status not in (503, 529) else "rejected"


@web.middleware
async def observe_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.method not in OBSERVED_METHODS:
        return await handler(request)
    observers = request.app[MANAGER].observers
    record = RequestRecord(method=request.method, route=request.path,
                           api=api_of(request).value, observers=observers)
    if OWN_ID in request:
        # The request-id middleware's ids: the router's own, and the client's.
        record.id = request[OWN_ID]
        if request[REQUEST_ID] != record.id:
            record.client_request_id = request[REQUEST_ID]
    request[RECORD] = record
    token = current_record.set(record)
    observers.request_started(record)
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        record.outcome, record.status = "cancelled", 499
        raise
    except web.HTTPException as exc:
        record.status = exc.status
        record.outcome = _outcome(exc.status)
        raise
    else:
        record.status = response.status
        if record.outcome is None:
            record.outcome = _outcome(response.status)
        return response
    finally:
        record.finished = time.monotonic()
        current_record.reset(token)
        observers.request_finished(record)
