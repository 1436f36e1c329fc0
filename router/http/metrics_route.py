"""GET /metrics: Prometheus text format (docs/metrics.md).

llama.cpp serves /metrics only (no /v1/metrics), and so do we. `?model=NAME`
(or an alias) narrows the answer to one model's series; an unknown name is a
404 in llama.cpp's error shape. A scrape reads what the engines last
published: it never loads, wakes or waits on a model. Whether it needs an API
key is the authentication middleware's business.
"""

from __future__ import annotations

from aiohttp import web

from router.http.keys import MANAGER, STARTED
from router.observability.metrics import ServerMetrics

METRICS = web.AppKey("metrics", ServerMetrics)
# The classic text format, which every Prometheus and llama.cpp client reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def attach_metrics(app: web.Application) -> None:
    """Create the app's metrics and subscribe them to its manager's events
    (router/http/routes.py serves them)."""
    manager = app[MANAGER]
    metrics = ServerMetrics(manager)
    metrics.subscribe(manager.observers)
    app[METRICS] = metrics


async def serve_metrics(request: web.Request) -> web.Response:
    name = request.query.get("model")
    # resolve() is a catalog lookup (404 model_not_found for an unknown
    # name); on a single-model server every name is its model.
    model = request.app[MANAGER].resolve(name).id if name else None
    body = request.app[METRICS].render(model)
    # As llama-server does: a scraper sees a restart (counters back at zero)
    # when this changes.
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE,
                                            "Process-Start-Time-Unix": str(request.app[STARTED])})
