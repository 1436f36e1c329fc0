"""The aiohttp application: routes, middleware and the model manager."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from router.anthropic.routes import ROUTES as ANTHROPIC_ROUTES
from router.http import models_api
from router.http.auth import KEY_STORE, KeyStore, auth_middleware
from router.http.cors import add_cors_headers, cors_middleware
from router.http.errors import error_middleware
from router.http.keys import MANAGER, STARTED
from router.http.metrics_route import add_routes as add_metrics_routes
from router.http.observe import observe_middleware
from router.http.readiness import readiness_middleware
from router.http.status import health, load, stats
from router.http.token_count_gate import token_count_gate
from router.lifecycle import ModelManager
from router.llamacpp.routes import add_routes as add_llamacpp_routes
from router.openai.chat import chat_completions
from router.openai.completions import completions
from router.responses.routes import ROUTES as RESPONSES_ROUTES

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/health", health),
    ("GET", "/v1/health", health),
    ("GET", "/v1/load", load),
    ("GET", "/stats", stats),
    ("GET", "/models", models_api.list_models),
    ("GET", "/v1/models", models_api.list_models),
    ("POST", "/models/load", models_api.load_model),
    ("POST", "/models/unload", models_api.unload_model),
    ("POST", "/models/sleep", models_api.sleep_model),
    ("GET", "/models/sse", models_api.model_events),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
]


def add_routes(app: web.Application, routes: list[tuple[str, str, Handler]]) -> None:
    """Register routes; every /v1/... path also answers under /v1/v1/... for
    clients whose base URL already ends in /v1."""
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
        if path.startswith("/v1/"):
            app.router.add_route(method, "/v1" + path, handler)


def create_app(manager: ModelManager) -> web.Application:
    """Raises AuthConfigError for keys that cannot be served (a bad key file)."""
    config = manager.config
    keys = KeyStore.from_config(config)
    # Outermost first: CORS answers preflights (its headers go on every
    # response, 401s included, through on_response_prepare); every request
    # gets its record, then errors are rendered in the route's shape, then
    # the API key is checked (so a 401 has the route's shape too), token
    # counting is bounded, then a loading single model answers 503.
    middlewares: list[Middleware] = [
        observe_middleware,
        error_middleware,
        auth_middleware(keys, metrics_open=config.metrics_open),
        token_count_gate(config.max_token_count_requests),
        readiness_middleware,
    ]
    if config.cors:
        middlewares.insert(0, cors_middleware)
    app = web.Application(
        middlewares=middlewares,
        # Bodies above this are refused before parsing (413 request_too_large).
        client_max_size=int(config.max_request_mib * (1 << 20)),
    )
    if config.cors:
        app.on_response_prepare.append(add_cors_headers)
    app[MANAGER] = manager
    app[KEY_STORE] = keys
    app[STARTED] = int(time.time())
    add_routes(app, ROUTES + RESPONSES_ROUTES + ANTHROPIC_ROUTES)
    add_llamacpp_routes(app)
    add_metrics_routes(app)

    async def stop_engines(_: web.Application) -> None:
        await manager.close()

    app.on_shutdown.append(stop_engines)
    return app
