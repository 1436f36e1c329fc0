"""The aiohttp application: routes, middleware and the model manager."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from router.anthropic.routes import ROUTES as ANTHROPIC_ROUTES
from router.http import models_api
from router.http.errors import error_middleware
from router.http.keys import MANAGER, STARTED
from router.http.readiness import readiness_middleware
from router.http.status import health, load
from router.lifecycle import ModelManager
from router.llamacpp.routes import add_routes as add_llamacpp_routes
from router.openai.chat import chat_completions
from router.openai.completions import completions
from router.responses.routes import ROUTES as RESPONSES_ROUTES

# Bodies above this are refused before parsing (413).
MAX_BODY_BYTES = 64 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/health", health),
    ("GET", "/v1/health", health),
    ("GET", "/v1/load", load),
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
    app = web.Application(
        middlewares=[error_middleware, readiness_middleware], client_max_size=MAX_BODY_BYTES
    )
    app[MANAGER] = manager
    app[STARTED] = int(time.time())
    add_routes(app, ROUTES + RESPONSES_ROUTES + ANTHROPIC_ROUTES)
    add_llamacpp_routes(app)

    async def stop_engines(_: web.Application) -> None:
        await manager.close()

    app.on_shutdown.append(stop_engines)
    return app
