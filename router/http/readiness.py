"""A single-model server answers every route (but the web page's files) with
503 until its model first loads, so clients and load balancers can tell
"starting" from "down", and a port clash shows at once (the port is bound
before the load starts)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.http.errors import ApiError
from router.http.keys import MANAGER
from router.http.webui import serves_page


@web.middleware
async def readiness_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    manager = request.app[MANAGER]
    # The page needs no model: it opens and shows the load as it goes.
    if manager.single and not manager.ready_once and not serves_page(request):
        raise ApiError(503, "Loading model", code="model_loading", headers={"Retry-After": "1"})
    return await handler(request)
