"""The aiohttp application: routes, middleware and the model manager."""

from __future__ import annotations

import time

from aiohttp import web
from aiohttp.typedefs import Middleware

from router.http.auth import KEY_STORE, KeyStore, auth_middleware
from router.http.connections import body_timeout_middleware, busy_middleware
from router.http.cors import CorsPolicy, refuse_options
from router.http.errors import error_middleware
from router.http.host_check import host_check_middleware
from router.http.keys import IMAGES, MANAGER, STARTED
from router.http.metrics_route import attach_metrics
from router.http.observe import observe_middleware
from router.http.readiness import readiness_middleware
from router.http.request_id import add_request_id, request_id_middleware
from router.http.routes import ROUTES, WEBUI_ROUTES, add_routes
from router.http.token_count_gate import token_count_gate
from router.lifecycle import ModelManager
from router.media.image_loader import ImageLoader


def create_app(manager: ModelManager) -> web.Application:
    """Raises AuthConfigError for keys that cannot be served (a bad key file)."""
    config = manager.config
    keys = KeyStore.from_config(config)
    cors = CorsPolicy(frozenset(config.cors_origins)) if config.cors else None
    host_check = host_check_middleware(config)
    # Outermost first: the connection learns that a request started (no
    # deadline may cut it: router/http/connections.py); every request gets its
    # id and its record; errors are rendered in the route's shape, so every
    # refusal below has it: a Host that does not name this server (DNS
    # rebinding), then CORS answers preflights before the API key is checked
    # (its headers go on every response, 401s included, through
    # on_response_prepare); OPTIONS that CORS did not answer is a 405; the
    # body is read within its deadline; token counting is bounded; a loading
    # single model answers 503.
    middlewares: list[Middleware] = [
        busy_middleware,
        request_id_middleware,
        observe_middleware,
        error_middleware,
        *([host_check] if host_check is not None else []),
        *([cors.middleware()] if cors is not None else []),
        auth_middleware(keys, metrics_open=config.metrics_open),
        refuse_options,
        body_timeout_middleware(config.http_body_timeout_ms / 1000),
        token_count_gate(config.max_token_count_requests),
        readiness_middleware,
    ]
    app = web.Application(
        middlewares=middlewares,
        # Bodies above this are refused before parsing (413 request_too_large).
        client_max_size=int(config.max_request_mib * (1 << 20)),
    )
    app.on_response_prepare.append(add_request_id)
    if cors is not None:
        app.on_response_prepare.append(cors.add_headers)
    app[MANAGER] = manager
    app[IMAGES] = images = ImageLoader(config.media,
                                       allow_private_addresses=config.media_allow_private_urls)
    app[KEY_STORE] = keys
    app[STARTED] = int(time.time())
    attach_metrics(app)
    add_routes(app, ROUTES + (WEBUI_ROUTES if config.webui else []))

    async def stop_engines(_: web.Application) -> None:
        await manager.close()

    async def close_fetcher(_: web.Application) -> None:
        await images.close()

    app.on_shutdown.append(stop_engines)
    app.on_cleanup.append(close_fetcher)
    return app
