"""The aiohttp application: routes, middleware and the model manager."""

from __future__ import annotations

import time

from aiohttp import web
from aiohttp.typedefs import Middleware

from router.http.auth import KEY_STORE, KeyStore, auth_middleware
from router.http.cors import add_cors_headers, cors_middleware
from router.http.errors import error_middleware
from router.http.keys import MANAGER, STARTED
from router.http.metrics_route import attach_metrics
from router.http.observe import observe_middleware
from router.http.readiness import readiness_middleware
from router.http.routes import ROUTES, add_routes
from router.http.token_count_gate import token_count_gate
from router.lifecycle import ModelManager


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
    attach_metrics(app)
    add_routes(app, ROUTES)

    async def stop_engines(_: web.Application) -> None:
        await manager.close()

    app.on_shutdown.append(stop_engines)
    return app
