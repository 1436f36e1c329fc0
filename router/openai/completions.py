"""POST /v1/completions (the legacy text completion API)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.build_info import build_fingerprint
from router.generation import Generation, new_request_id
from router.http.errors import decode_body, invalid
from router.http.keys import MANAGER
from router.http.sse import StreamOpenedError
from router.lifecycle import ModelSlot
from router.openai.common import (
    autoload,
    collect,
    now,
    start_generation,
    stream_generation,
    streaming_lease,
    usage,
    wants_usage,
)
from router.openai.guided import completion_constraint
from router.openai.params import check_common, check_max_tokens, logit_bias
from router.openai.schemas import CompletionRequest
from router.output_budget import fits
from router.sampling import check_logit_bias
from router.text.model_text import ModelText


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def _single_prompt(prompt: str | list[Any]) -> str | list[int]:
    """A string or token ids; this server answers one prompt per request."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return prompt
    if len(prompt) != 1:
        raise invalid(f"'prompt' holds {len(prompt)} prompts; send one prompt per request", "prompt")
    (single,) = prompt
    if isinstance(single, str) or _is_token_ids(single):
        return single
    raise invalid("'prompt' must be a string, a list of token ids, or a list holding one of those",
                  "prompt", "invalid_type")


async def _prompt_ids(prompt: str | list[int], text: ModelText) -> list[int]:
    if not prompt:
        raise invalid("'prompt' is empty", "prompt")
    if isinstance(prompt, str):
        return await text.encode_prompt_async(prompt)
    return list(prompt)


def _check_vocab(prompt_ids: list[int], n_vocab: int) -> None:
    # The model's embedding may have more rows than the tokenizer has tokens.
    bad = next((t for t in prompt_ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise invalid(f"token id {bad} in 'prompt' is outside the vocabulary (0..{n_vocab - 1})", "prompt")


def _refuse_what_we_cannot_do(req: CompletionRequest) -> None:
    if req.logprobs is not None:
        raise invalid("'logprobs' is not supported yet", "logprobs", "unsupported_parameter")
    if req.best_of not in (None, 1):
        raise invalid(f"'best_of' must be 1: this server generates one completion per request, "
                      f"got {req.best_of}", "best_of", "unsupported_parameter")


async def completions(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), CompletionRequest)
    check_common(req)
    check_max_tokens(req.max_tokens, "max_tokens")
    if req.suffix:
        raise invalid("'suffix' (fill-in-the-middle) is not supported", "suffix")
    _refuse_what_we_cannot_do(req)
    grammar = completion_constraint(req)
    biases = logit_bias(req.logit_bias)
    prompt = _single_prompt(req.prompt)

    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    text = await manager.text_for(slot)
    prompt_ids = await _prompt_ids(prompt, text)
    echo = ""
    if req.echo:
        echo = prompt if isinstance(prompt, str) else text.tokenizer.decode(prompt, skip_special_tokens=False)

    def admit(loaded: ModelSlot) -> None:
        assert loaded.ready is not None
        _check_vocab(prompt_ids, loaded.ready.model.n_vocab)
        check_logit_bias(biases, loaded.ready.model.n_vocab)
        fits(len(prompt_ids), req.max_tokens, loaded.max_context, param="prompt")

    lease = manager.lease(slot, autoload=autoload(request), on_admit=admit)
    if req.stream:
        lease = streaming_lease(request, lease)
    try:
        async with lease as engine:
            generation = start_generation(
                request.app, slot, engine, text, req, prompt_ids,
                new_request_id("cmpl"), req.max_tokens, "max_tokens", grammar=grammar,
            )
            if req.stream:
                return await _stream(request, generation, slot.id, wants_usage(req), echo)
            completion = await collect(generation)
    except StreamOpenedError as opened:
        return opened.response
    return web.json_response({
        "id": generation.request_id,
        "object": "text_completion",
        "created": now(),
        "model": slot.id,
        "system_fingerprint": build_fingerprint(),
        "choices": [{
            "text": echo + completion,
            "index": 0,
            "logprobs": None,
            "finish_reason": generation.finish_reason,
        }],
        "usage": usage(generation),
        "timings": generation.timings(),
    })


async def _stream(
    request: web.Request, generation: Generation, model: str, include_usage: bool, echo: str
) -> web.StreamResponse:
    created = now()

    def chunk(piece: str | None, finish_reason: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": generation.request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": build_fingerprint(),
            "choices": [{"text": piece or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        return body

    opening = [chunk(echo, None)] if echo else []
    return await stream_generation(
        request, generation, chunk, opening=opening, include_usage=include_usage
    )
