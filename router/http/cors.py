"""Permissive CORS (--cors): a browser page from any origin may call the API.

The middleware answers preflights (OPTIONS with Access-Control-Request-Method)
with 204 before observation, auth or any handler; a browser sends no
credentials with them. Every other response gets its headers from the
on_response_prepare hook rather than from the middleware, because streamed
responses send their headers from inside the handler, and error responses
(401s included) must carry them too, or the page cannot read the error.
Without --cors neither is installed and no CORS header is sent at all.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
# Offered when a preflight names no headers of its own.
DEFAULT_ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version"
# Headers our responses carry that a page may want to read.
EXPOSE_HEADERS = "Request-Id, X-Request-Id, Retry-After, WWW-Authenticate"
# Browsers cap it lower (Chromium: 2 hours); the cap then applies.
MAX_AGE_SECONDS = 86400


def is_preflight(request: web.Request) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


@web.middleware
async def cors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    if not is_preflight(request):
        return await handler(request)
    headers = {
        "Access-Control-Allow-Methods": ALLOW_METHODS,
        "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers")
        or DEFAULT_ALLOW_HEADERS,
        "Access-Control-Max-Age": str(MAX_AGE_SECONDS),
    }
    # Chromium asks before a public page may call a server on a private address
    # (a local model server is the common case).
    if request.headers.get("Access-Control-Request-Private-Network") == "true":
        headers["Access-Control-Allow-Private-Network"] = "true"
    return web.Response(status=204, headers=headers)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: just before any response's headers go out."""
    origin = request.headers.get("Origin")
    response.headers["Access-Control-Allow-Origin"] = origin or "*"
    if origin:
        # The answer depends on the Origin: caches must not share it.
        vary = response.headers.get("Vary")
        response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
    response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
