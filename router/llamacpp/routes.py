"""The route table of llama.cpp's native API."""

from __future__ import annotations

from aiohttp import web

from router.llamacpp.completion import completion
from router.llamacpp.props import get_props, post_props
from router.llamacpp.template import apply_template
from router.llamacpp.tokens import detokenize, tokenize


def add_routes(app: web.Application) -> None:
    """Register llama.cpp's native endpoints. /completions is llama.cpp's too,
    as in llama.cpp's server (OpenAI's Completions answer at /v1/completions)."""
    add = app.router.add_route
    add("POST", "/completion", completion)
    add("POST", "/completions", completion)
    add("POST", "/tokenize", tokenize)
    add("POST", "/detokenize", detokenize)
    add("POST", "/apply-template", apply_template)
    add("GET", "/props", get_props)
    add("POST", "/props", post_props)
