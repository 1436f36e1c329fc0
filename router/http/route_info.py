"""What the route table says about each route: which API it belongs to (its
error shape, its request id header) and who may call it.

A route speaks one API, except where a request header says the client is
another API's SDK: `Route.header_apis` maps such a header to the API it
selects (GET /v1/models answers Anthropic's SDK, which always sends
`anthropic-version`, in Anthropic's shapes and everyone else in OpenAI's).
api_of() makes that choice per request; handlers and the error middleware
both ask it, so a body and its errors always agree.

Kept apart from the table itself (router/http/routes.py), which imports every
handler, so the middlewares can read it without an import circle.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Api(enum.Enum):
    """The protocol a route speaks: it decides the error shape."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    LLAMACPP = "llamacpp"


class Access(enum.Enum):
    """Who may call a route when API keys are configured."""

    KEY = "key"  # a valid key
    OPEN = "open"  # anyone (health probes)
    METRICS = "metrics"  # anyone with --metrics-open, else a key


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    api: Api
    access: Access = Access.KEY
    # (header, api): a request carrying the header speaks that API instead;
    # the first header present wins.
    header_apis: tuple[tuple[str, Api], ...] = ()


ROUTE_TABLE = web.AppKey("route_table", dict)


def route_of(request: web.Request) -> Route | None:
    """The table's entry for the route the request matched (None for a path
    that matched nothing, and for a method the path does not allow)."""
    table = request.app.get(ROUTE_TABLE)
    if table is None:
        return None
    return table.get(request.match_info.route)


def api_for_path(path: str) -> Api:
    """A guess for paths that matched no route: the prefix says which API the
    client meant."""
    if path.startswith("/v1/v1/"):
        path = path[3:]
    if path.startswith("/v1/messages"):
        return Api.ANTHROPIC
    if path.startswith(("/v1/", "/chat/completions", "/responses")) or path == "/embeddings":
        return Api.OPENAI
    return Api.LLAMACPP


def api_of(request: web.Request) -> Api:
    """The API a request speaks: its route's, unless it carries one of the
    route's switching headers; a guess from the path when no route matched."""
    route = route_of(request)
    if route is None:
        return api_for_path(request.path)
    for header, api in route.header_apis:
        if header in request.headers:
            return api
    return route.api
