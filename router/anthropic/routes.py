"""The Messages API routes, for router/app.py to register (each /v1/... path
also answers under /v1/v1/...)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from router.anthropic.handlers import count_tokens, create_message

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/v1/messages", create_message),
    ("POST", "/v1/messages/count_tokens", count_tokens),
]
