"""The aiohttp application: routes, middleware and the model manager."""

from __future__ import annotations

import time

from aiohttp import web

from router.http.errors import error_middleware
from router.http.status import health, load
from router.lifecycle import ModelManager
from router.openai.chat import chat_completions
from router.openai.common import DEFAULTS, MANAGER
from router.openai.completions import completions
from router.openai.models import STARTED, list_models

# Bodies above this are refused before parsing (413).
MAX_BODY_BYTES = 64 << 20


def create_app(manager: ModelManager) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[MANAGER] = manager
    app[DEFAULTS] = {}
    app[STARTED] = int(time.time())
    app.router.add_get("/health", health)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/load", load)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/completions", completions)

    async def stop_engines(_: web.Application) -> None:
        await manager.close()

    app.on_shutdown.append(stop_engines)
    return app
