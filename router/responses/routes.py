"""The Responses API's routes, for router/app.py to register (which also
answers them under /v1/v1/...)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from router.responses.handlers import (
    cancel_response,
    count_input_tokens,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/v1/responses", create_response),
    ("POST", "/v1/responses/input_tokens", count_input_tokens),
    ("GET", "/v1/responses/{response_id}", retrieve_response),
    ("DELETE", "/v1/responses/{response_id}", delete_response),
    ("GET", "/v1/responses/{response_id}/input_items", list_input_items),
    ("POST", "/v1/responses/{response_id}/cancel", cancel_response),
]
