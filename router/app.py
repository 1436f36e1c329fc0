"""The aiohttp application: routes, middleware and the model manager."""

from __future__ import annotations

import time

from aiohttp import web

from router.http import models_api
from router.http.errors import error_middleware
from router.http.keys import DEFAULTS, MANAGER, STARTED
from router.http.readiness import readiness_middleware
from router.http.status import health, load
from router.lifecycle import ModelManager
from router.openai.chat import chat_completions
from router.openai.completions import completions

# Bodies above this are refused before parsing (413).
MAX_BODY_BYTES = 64 << 20


def create_app(manager: ModelManager) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware, readiness_middleware], client_max_size=MAX_BODY_BYTES
    )
    app[MANAGER] = manager
    app[DEFAULTS] = {}
    app[STARTED] = int(time.time())
    add = app.router
    add.add_get("/health", health)
    add.add_get("/v1/health", health)
    add.add_get("/v1/load", load)
    add.add_get("/models", models_api.list_models)
    add.add_get("/v1/models", models_api.list_models)
    add.add_post("/models/load", models_api.load_model)
    add.add_post("/models/unload", models_api.unload_model)
    add.add_post("/models/sleep", models_api.sleep_model)
    add.add_get("/models/sse", models_api.model_events)
    add.add_post("/v1/chat/completions", chat_completions)
    add.add_post("/chat/completions", chat_completions)
    add.add_post("/v1/completions", completions)
    add.add_post("/completions", completions)

    async def stop_engines(_: web.Application) -> None:
        await manager.close()

    app.on_shutdown.append(stop_engines)
    return app
