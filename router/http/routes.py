"""Every route the router serves, in one table: method, path, handler, the
API it speaks (its error shape) and who may call it (router/http/route_info.py).

Each /v1/... path also answers under /v1/v1/..., for clients whose base URL
already ends in /v1.
"""

from __future__ import annotations

from aiohttp import web

from router.anthropic.handlers import count_tokens, create_message
from router.http import models_api, webui
from router.http.metrics_route import serve_metrics
from router.http.route_info import ROUTE_TABLE, Access, Api, Route
from router.http.status import health, load, stats
from router.llamacpp.completion import completion
from router.llamacpp.embedding import embedding
from router.llamacpp.infill import infill
from router.llamacpp.props import get_props, post_props
from router.llamacpp.slots import get_slots, post_slot
from router.llamacpp.template import apply_template
from router.llamacpp.tokens import detokenize, tokenize
from router.openai import models as openai_models
from router.openai.chat import chat_completions
from router.openai.chat_tokens import count_chat_tokens
from router.openai.completions import completions
from router.openai.embeddings import embeddings
from router.rerank.handler import rerank
from router.responses.handlers import (
    cancel_response,
    count_input_tokens,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)

OAI, ANT, LCP = Api.OPENAI, Api.ANTHROPIC, Api.LLAMACPP
# Anthropic's SDK sends this header on every call; OpenAI's never does.
ANTHROPIC_SDK = (("anthropic-version", ANT),)

ROUTES: list[Route] = [
    # Probes and load: cheap, never wait on an engine.
    Route("GET", "/health", health, LCP, Access.OPEN),
    Route("GET", "/v1/health", health, OAI, Access.OPEN),
    Route("GET", "/v1/load", load, OAI),
    Route("GET", "/stats", stats, LCP),
    Route("GET", "/metrics", serve_metrics, LCP, Access.METRICS),
    # The model catalog, as llama.cpp's router serves it.
    Route("GET", "/models", models_api.list_models, LCP),
    # The SDKs' models API: OpenAI's shapes, Anthropic's for Anthropic's SDK.
    Route("GET", "/v1/models", openai_models.list_models, OAI, header_apis=ANTHROPIC_SDK),
    Route("GET", "/v1/models/{model_id:.+}", openai_models.retrieve_model, OAI,
          header_apis=ANTHROPIC_SDK),
    Route("POST", "/models/load", models_api.load_model, LCP),
    Route("POST", "/models/unload", models_api.unload_model, LCP),
    Route("POST", "/models/sleep", models_api.sleep_model, LCP),
    Route("GET", "/models/sse", models_api.model_events, LCP),
    # llama.cpp's download and cache deletion: refused with 405 (models_api.model_store).
    Route("POST", "/models", models_api.model_store, LCP),
    Route("DELETE", "/models", models_api.model_store, LCP),
    # OpenAI.
    Route("POST", "/v1/chat/completions", chat_completions, OAI),
    Route("POST", "/chat/completions", chat_completions, OAI),
    Route("POST", "/v1/chat/completions/input_tokens", count_chat_tokens, OAI),
    Route("POST", "/chat/completions/input_tokens", count_chat_tokens, OAI),
    Route("POST", "/v1/completions", completions, OAI),
    Route("POST", "/v1/embeddings", embeddings, OAI),
    Route("POST", "/v1/responses", create_response, OAI),
    Route("POST", "/v1/responses/input_tokens", count_input_tokens, OAI),
    # Unprefixed, as llama.cpp serves them too.
    Route("POST", "/responses", create_response, OAI),
    Route("POST", "/responses/input_tokens", count_input_tokens, OAI),
    Route("GET", "/v1/responses/{response_id}", retrieve_response, OAI),
    Route("DELETE", "/v1/responses/{response_id}", delete_response, OAI),
    Route("GET", "/v1/responses/{response_id}/input_items", list_input_items, OAI),
    Route("POST", "/v1/responses/{response_id}/cancel", cancel_response, OAI),
    # Anthropic.
    Route("POST", "/v1/messages", create_message, ANT),
    Route("POST", "/v1/messages/count_tokens", count_tokens, ANT),
    # llama.cpp's native API. /completions is llama.cpp's too, as in its
    # server (OpenAI's Completions answer at /v1/completions).
    Route("POST", "/completion", completion, LCP),
    Route("POST", "/completions", completion, LCP),
    Route("POST", "/infill", infill, LCP),
    # llama.cpp's embeddings answer (not OpenAI's) under both of its names.
    Route("POST", "/embedding", embedding, LCP),
    Route("POST", "/embeddings", embedding, LCP),
    Route("POST", "/tokenize", tokenize, LCP),
    Route("POST", "/detokenize", detokenize, LCP),
    Route("POST", "/apply-template", apply_template, LCP),
    Route("GET", "/props", get_props, LCP),
    Route("POST", "/props", post_props, LCP),
    Route("GET", "/slots", get_slots, LCP),
    Route("POST", "/slots/{id_slot}", post_slot, LCP),
    # Rerank under llama.cpp's four paths, in Jina's and Cohere's shape
    # (router/rerank/); the /v1 ones answer errors in OpenAI's shape.
    Route("POST", "/rerank", rerank, LCP),
    Route("POST", "/reranking", rerank, LCP),
    Route("POST", "/v1/rerank", rerank, OAI),
    Route("POST", "/v1/reranking", rerank, OAI),
]

# The web page (docs/webui.md), left out with --no-webui. Open: the page holds
# no data, and each API call it makes carries the user's key.
WEBUI_ROUTES: list[Route] = [
    Route("GET", "/", webui.index, LCP, Access.OPEN),
    Route("GET", "/ui/{name}", webui.asset, LCP, Access.OPEN),
]


def add_routes(app: web.Application, routes: list[Route]) -> None:
    """Register the routes and remember each one's entry for the middlewares."""
    table: dict[web.AbstractRoute, Route] = {}
    for route in routes:
        paths = [route.path]
        if route.path.startswith("/v1/"):
            paths.append("/v1" + route.path)
        # HEAD answers wherever GET does, under the same rules.
        methods = [route.method, "HEAD"] if route.method == "GET" else [route.method]
        for path in paths:
            for method in methods:
                table[app.router.add_route(method, path, route.handler)] = route
    app[ROUTE_TABLE] = table
