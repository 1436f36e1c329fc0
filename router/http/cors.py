"""CORS (--cors, --cors-origins): which web pages may call the API from a browser.

The middleware answers preflights (OPTIONS with Access-Control-Request-Method)
before auth or any handler, as llama.cpp's server does: 200, an empty body,
the page's Origin echoed in Access-Control-Allow-Origin; a browser sends no
credentials with them. A preflight from an origin not on the list gets 403
and no CORS header, whatever the path, so preflights tell nothing of which
routes exist. Every other response gets its headers from the
on_response_prepare hook rather than from the middleware, because streamed
responses send their headers from inside the handler, and error responses
(401s included) must carry them too, or the page cannot read the error.

Without CORS no CORS header is sent at all. Every OPTIONS request that is
not a preflight CORS answered is a 405 on every path, known or not, and asks
for a key first like any request (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from router.http.errors import ApiError

ANY_ORIGIN = "*"
ALLOW_METHODS = "GET, HEAD, POST, DELETE, OPTIONS"
# Offered when a preflight names no headers of its own.
DEFAULT_ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version"
# Headers our responses carry that a page may want to read.
EXPOSE_HEADERS = "Request-Id, X-Request-Id, Retry-After, WWW-Authenticate"
# Browsers cap it lower (Chromium: 2 hours); the cap then applies.
MAX_AGE_SECONDS = 86400


def origins(text: str) -> tuple[str, ...]:
    """--cors-origins: comma-separated origins (scheme://host[:port]), or '*'."""
    parsed: list[str] = []
    for word in text.split(","):
        word = word.strip()
        if not word:
            continue
        if word == ANY_ORIGIN:
            parsed.append(word)
            continue
        parts = urlsplit(word.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path \
                or parts.query or parts.fragment or "@" in parts.netloc:
            raise ValueError(f"--cors-origins: {word!r} is not an origin such as "
                             "https://app.example.com or http://localhost:3000")
        parsed.append(f"{parts.scheme}://{parts.netloc.lower()}")
    if not parsed:
        raise ValueError("--cors-origins: give at least one origin, or '*'")
    return tuple(dict.fromkeys(parsed))


@dataclass(frozen=True)
class CorsPolicy:
    """The origins whose pages may call the API; '*' among them means any."""

    origins: frozenset[str]

    @property
    def any_origin(self) -> bool:
        return ANY_ORIGIN in self.origins

    def allows(self, origin: str | None) -> bool:
        if self.any_origin:
            return True
        return origin is not None and origin.rstrip("/").lower() in self.origins

    def middleware(self) -> Middleware:
        @web.middleware
        async def answer_preflight(request: web.Request, handler: Any) -> web.StreamResponse:
            if not is_preflight(request):
                return await handler(request)
            if not self.allows(request.headers.get("Origin")):
                raise ApiError(403, "this origin may not call the API from a browser "
                                    "(--cors-origins)", type="permission_error",
                               code="cors_origin_not_allowed")
            headers = {
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers":
                    request.headers.get("Access-Control-Request-Headers") or DEFAULT_ALLOW_HEADERS,
                "Access-Control-Max-Age": str(MAX_AGE_SECONDS),
            }
            # Chromium asks before a public page may call a server on a private
            # address (a local model server is the common case).
            if request.headers.get("Access-Control-Request-Private-Network") == "true":
                headers["Access-Control-Allow-Private-Network"] = "true"
            return web.Response(status=200, headers=headers)

        return answer_preflight

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: just before any response's headers go out."""
        origin = request.headers.get("Origin")
        if not self.any_origin or origin:
            # The answer depends on the Origin: caches must not share it.
            vary = response.headers.get("Vary")
            response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
        if not self.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = origin or ANY_ORIGIN
        if origin and not self.any_origin:
            # As llama.cpp does, but only for origins the operator named: with
            # '*', a page anywhere could ride on credentials a browser keeps
            # for a proxy in front of us.
            response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS


def is_preflight(request: web.Request) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


@web.middleware
async def refuse_options(request: web.Request, handler: Any) -> web.StreamResponse:
    """OPTIONS that CORS did not answer: a 405 on every path, known or not."""
    if request.method == "OPTIONS":
        raise ApiError(405, "OPTIONS is served only for CORS preflights, with --cors or "
                            "--cors-origins", code="method_not_allowed")
    return await handler(request)
