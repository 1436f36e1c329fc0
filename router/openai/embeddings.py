"""POST /v1/embeddings (OpenAI's Embeddings API; the work is router/embeddings.py).

`input` is a string, a list of strings, a list of token ids, or a list of
token-id lists; `encoding_format` "float" (default) or "base64" (the
little-endian float32 bytes); `dimensions` only the model's own size;
`model` and `user` as usual. llama.cpp's `embd_normalize` is honoured here
too, as llama.cpp's /v1/embeddings does (default 2: unit length).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from router.embeddings import (
    as_base64,
    as_floats,
    check_count,
    check_normalize,
    encode_texts,
    is_token_ids,
    run_embeddings,
)
from router.engine_client import EngineFailure
from router.http.errors import decode_body, engine_error, invalid
from router.http.keys import MANAGER
from router.openai.common import autoload

ENCODINGS = ("float", "base64")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # A string, token ids, or a list of either (checked below: msgspec unions
    # allow only one array type).
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    # An end-user id for abuse monitoring: accepted, without effect here.
    user: str | None = None
    embd_normalize: int = 2


def split_input(value: str | list[Any]) -> tuple[list[str], list[list[int]]]:
    """(texts, token-id inputs): one of the two is empty."""
    if isinstance(value, str):
        return [value], []
    check_count(len(value), "input")
    if all(isinstance(item, str) for item in value):
        return value, []
    if is_token_ids(value):
        return [], [value]
    if all(is_token_ids(item) for item in value):
        return [], value
    raise invalid("'input' must be a string, a list of strings, a list of token ids or a list "
                  "of token-id lists", "input", "invalid_type")


async def embeddings(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), EmbeddingRequest)
    if req.encoding_format not in ENCODINGS:
        raise invalid(f"'encoding_format' must be float or base64, got {req.encoding_format!r}",
                      "encoding_format")
    if req.dimensions is not None and req.dimensions < 1:
        raise invalid(f"'dimensions' must be at least 1, got {req.dimensions}", "dimensions")
    check_normalize(req.embd_normalize)
    texts, inputs = split_input(req.input)
    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    if texts:
        inputs = await encode_texts(await manager.text_for(slot), texts, "input")
    try:
        vectors = await run_embeddings(manager, slot, inputs, autoload=autoload(request),
                                       param="input", normalize=req.embd_normalize,
                                       dimensions=req.dimensions)
    except EngineFailure as exc:
        raise engine_error(exc) from None
    encode = as_base64 if req.encoding_format == "base64" else as_floats
    tokens = sum(len(ids) for ids in inputs)
    body: dict[str, Any] = {
        "object": "list",
        "data": [{"object": "embedding", "index": index, "embedding": encode(vector)}
                 for index, vector in enumerate(vectors)],
        "model": slot.id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    # Thousands of floats: msgspec writes them many times faster than json.
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")
