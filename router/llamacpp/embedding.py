"""POST /embedding and /embeddings: llama.cpp's own (not OpenAI's) embeddings.

The body's `content` (or `input`, which llama.cpp reads first) is one prompt
or a list of them, each a string, token ids, or ids mixed with strings (as
/completion's prompt); `embd_normalize` is llama.cpp's (-1 none, 0 max
absolute scaled to int16 range, 1 taxicab, 2 Euclidean, the default; p > 2
the p-norm). The answer is llama.cpp's: one entry per prompt,
`[{"index": i, "embedding": [[...]]}]`, the pooled vector inside a list (a
server without pooling would list one vector per token there).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from router.embeddings import (
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
from router.llamacpp.prompt import prompt_ids
from router.openai.common import autoload
from router.text.model_text import ModelText


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    content: str | list[Any] | None = None
    input: str | list[Any] | None = None
    model: str | None = None
    embd_normalize: int = 2


def _is_mix(items: list[Any]) -> bool:
    """Token ids and strings together: one prompt (llama.cpp's "mixed" form)."""
    return (all(isinstance(i, str) or is_token_ids([i]) for i in items)
            and any(isinstance(i, str) for i in items) and any(is_token_ids([i]) for i in items))


def split_prompts(value: str | list[Any], param: str) -> list[str | list[Any]]:
    """The prompts of `content`, each a string, token ids or a mix."""
    if isinstance(value, str) or (is_token_ids(value) and value) or _is_mix(value):
        return [value]
    check_count(len(value), param)
    for index, item in enumerate(value):
        if not (isinstance(item, str)
                or (isinstance(item, list) and (is_token_ids(item) or _is_mix(item)))):
            raise invalid(f"'{param}[{index}]' must be a string, token ids, or token ids mixed "
                          "with strings", param, "invalid_type")
    return value


async def _tokens(text: ModelText | None, prompts: list[str | list[Any]], param: str
                  ) -> list[list[int]]:
    """Token ids of each prompt; strings with the model's special tokens."""
    if all(isinstance(item, str) for item in prompts):
        assert text is not None
        return await encode_texts(text, prompts, param)  # type: ignore[arg-type]
    inputs: list[list[int]] = []
    for index, item in enumerate(prompts):
        if isinstance(item, str):
            inputs += await encode_texts(text, [item], f"{param}[{index}]")  # type: ignore[arg-type]
        elif is_token_ids(item):
            inputs.append(list(item))
        else:
            # BOS only before a leading string (llama.cpp's rule), the
            # appended EOS (if the model has one) at the end.
            assert text is not None
            ids = await prompt_ids(item, text)
            eos = text.tokenizer.appended_eos_id
            inputs.append([*ids, eos] if eos is not None and ids[-1:] != [eos] else ids)
    return inputs


async def embedding(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), EmbeddingRequest)
    param = "input" if req.input is not None else "content"
    value = req.input if req.input is not None else req.content
    if value is None:
        raise invalid("'content' (or 'input') must be given", "content",
                      "missing_required_parameter")
    check_normalize(req.embd_normalize)
    prompts = split_prompts(value, param)
    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    has_text = any(isinstance(item, str) or not is_token_ids(item) for item in prompts)
    text = await manager.text_for(slot) if has_text else None
    inputs = await _tokens(text, prompts, param)
    try:
        vectors = await run_embeddings(manager, slot, inputs, autoload=autoload(request),
                                       param=param, normalize=req.embd_normalize)
    except EngineFailure as exc:
        raise engine_error(exc) from None
    body = [{"index": index, "embedding": [as_floats(vector)]}
            for index, vector in enumerate(vectors)]
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")
