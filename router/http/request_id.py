"""One id per request, sent back on every response as `x-request-id`.

The OpenAI SDKs read `x-request-id` into a response's `_request_id`; the
Anthropic SDK reads `request-id`, which Anthropic routes (and any handler
that set one) carry with the same value. A client's own `X-Request-Id` is
honoured when it is 1 to 128 printable ASCII characters without spaces, so a
gateway's id follows the request through; otherwise the router makes one,
the request's record id (`req-` and 16 hex digits). The request log keeps
both: `request_id` (always the router's own, unique) and `client_request_id`
(docs/observability.md).
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from router.http.route_info import Api, api_of
from router.observability.records import new_record_id

HEADER = "X-Request-Id"
ANTHROPIC_HEADER = "request-id"
MAX_LENGTH = 128
# Echoed in a header and written to logs: no spaces, no control characters.
_VALID = re.compile(rf"[\x21-\x7e]{{1,{MAX_LENGTH}}}\Z")

# The id the response carries, and the router's own id of the request.
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
OWN_ID: web.RequestKey[str] = web.RequestKey("own_request_id", str)


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id, when it is one we may echo."""
    value = request.headers.get(HEADER)
    return value if value is not None and _VALID.match(value) else None


def request_id_of(request: web.Request) -> str:
    """The id this request's responses carry (a fresh one outside the app)."""
    return request.get(REQUEST_ID) or new_record_id()


@web.middleware
async def request_id_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    own = new_record_id()
    request[OWN_ID] = own
    request[REQUEST_ID] = client_request_id(request) or own
    return await handler(request)


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response the app sends, errors and streams too."""
    request_id = request_id_of(request)
    response.headers[HEADER] = request_id
    if ANTHROPIC_HEADER in response.headers or api_of(request) is Api.ANTHROPIC:
        response.headers[ANTHROPIC_HEADER] = request_id
