"""POST /v1/completions (the legacy text completion API).

A prompt is a string or token ids, or a list of either: one choice per
prompt and per n, index prompt_index * n + i, run as concurrent engine
requests (router/openai/choices.py). best_of generates that many candidates
per prompt and returns the n most likely. With echo and logprobs the prompt
is scored too; max_tokens 0 (with echo) only scores it, as lm-eval-harness's
loglikelihood asks.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from aiohttp import web

from protocol import GrammarSpec
from router.build_info import build_fingerprint
from router.engine_client import EngineFailure
from router.generation import Piece, new_request_id
from router.http.errors import decode_body, engine_error, invalid, openai_error_body
from router.http.keys import MANAGER
from router.http.sse import (
    StreamOpenedError,
    open_event_stream,
    send_data,
    send_done,
)
from router.lifecycle import ModelSlot
from router.openai.choices import Sibling, run_siblings, sibling_seed, stream_siblings
from router.openai.common import (
    autoload,
    now,
    start_generation,
    stream_generation,
    streaming_lease,
    wants_usage,
)
from router.openai.completion_choice import ChunkHead, CompletionChoice, PromptInput
from router.openai.guided import completion_constraint
from router.openai.logprobs import TokenTexts
from router.openai.params import (
    check_choices,
    check_common,
    check_max_tokens,
    completion_logprobs,
    logit_bias,
    sampling_request,
)
from router.openai.schemas import CompletionRequest
from router.output_budget import fits
from router.sampling import SamplingRequest, check_logit_bias, resolve_seed
from router.supervisor import EngineProcess
from router.text.model_text import ModelText
from router.text.token_pieces import pieces_for


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The request's prompts: a string, token ids, or a list of those."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if not prompt:
        raise invalid("'prompt' is an empty list", "prompt")
    for index, single in enumerate(prompt):
        if not (isinstance(single, str) or _is_token_ids(single)):
            raise invalid("'prompt' must be a string, a list of token ids, or a list of strings "
                          "or of token id lists", f"prompt[{index}]", "invalid_type")
    return prompt


async def _prompt_ids(prompt: str | list[int], text: ModelText, param: str) -> list[int]:
    if not prompt:
        raise invalid("'prompt' is empty", param)
    if isinstance(prompt, str):
        return await text.encode_prompt_async(prompt)
    return list(prompt)


def _check_vocab(prompt_ids: list[int], n_vocab: int, param: str) -> None:
    # The model's embedding may have more rows than the tokenizer has tokens.
    bad = next((t for t in prompt_ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise invalid(f"token id {bad} in '{param}' is outside the vocabulary (0..{n_vocab - 1})",
                      param)


def _choice_counts(req: CompletionRequest) -> tuple[int, int]:
    """n, and the candidates generated per prompt (best_of, at least n)."""
    n = req.n or 1
    if req.best_of is None:
        return n, n
    if req.best_of < n:
        raise invalid(f"'best_of' ({req.best_of}) must be at least 'n' ({n}): it is how many "
                      "candidates the n choices are picked from", "best_of")
    if req.best_of > n and req.stream:
        raise invalid("'best_of' above 'n' cannot be streamed: the best choices are known "
                      "only once every candidate ends", "best_of")
    return n, req.best_of


def _check_max_tokens(req: CompletionRequest) -> None:
    if req.max_tokens == 0:
        if not req.echo:
            raise invalid("'max_tokens' 0 generates nothing: it scores the prompt, which needs "
                          "echo true (and logprobs for the scores)", "max_tokens")
        return
    check_max_tokens(req.max_tokens, "max_tokens")


async def completions(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), CompletionRequest)
    check_common(req)
    _check_max_tokens(req)
    if req.suffix:
        raise invalid("'suffix' (fill-in-the-middle) is not supported", "suffix")
    logprobs = completion_logprobs(req)
    n, candidates = _choice_counts(req)
    grammar = completion_constraint(req)
    biases = logit_bias(req.logit_bias)
    prompts = _prompts(req.prompt)
    params = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]

    manager = request.app[MANAGER]
    check_choices(len(prompts) * candidates, manager.config.max_choices,
                  "best_of" if candidates > n else "n")
    slot = manager.resolve(req.model)
    text = await manager.text_for(slot)
    inputs = []
    for prompt, param in zip(prompts, params, strict=True):
        ids = await _prompt_ids(prompt, text, param)
        echo = ""
        if req.echo:
            echo = prompt if isinstance(prompt, str) else \
                text.tokenizer.decode(ids, skip_special_tokens=False)
        inputs.append(PromptInput(ids, echo))

    def admit(loaded: ModelSlot) -> None:
        assert loaded.ready is not None
        for prompt, param in zip(inputs, params, strict=True):
            _check_vocab(prompt.ids, loaded.ready.model.n_vocab, param)
            fits(len(prompt.ids), req.max_tokens, loaded.max_context, param=param)
        check_logit_bias(biases, loaded.ready.model.n_vocab)

    lease = manager.lease(slot, autoload=autoload(request), on_admit=admit)
    if req.stream:
        lease = streaming_lease(request, lease)
    # The engine scores the sampled tokens for best_of even when the client
    # did not ask to see their logprobs.
    sampling = sampling_request(req, req.max_tokens,
                                logprobs=0 if logprobs < 0 and candidates > n else logprobs)
    texts = TokenTexts(pieces_for(text.tokenizer)) if logprobs >= 0 else None
    try:
        async with lease as engine:
            start = _ChoiceStarter(request.app, slot, engine, text, req, grammar, texts)
            groups = start.groups(inputs, sampling, candidates, logprobs)
            if req.stream:
                return await _stream(request, groups, wants_usage(req))
            await _collect(groups)
    except StreamOpenedError as opened:
        return opened.response
    first = groups[0][0]
    return web.json_response({
        "id": first.generation.request_id,
        "object": "text_completion",
        "created": now(),
        "model": slot.id,
        "system_fingerprint": build_fingerprint(),
        "choices": [choice.body() for choice in _best(groups, n)],
        "usage": _usage(groups),
        "timings": first.generation.timings(),
    })


class _ChoiceStarter:
    """The choices of a request, their generations made (not yet submitted)."""

    def __init__(self, app: web.Application, slot: ModelSlot, engine: EngineProcess,
                 text: ModelText, req: CompletionRequest, grammar: GrammarSpec | None,
                 texts: TokenTexts | None):
        self.app, self.slot, self.engine, self.text = app, slot, engine, text
        self.req, self.grammar, self.texts = req, grammar, texts
        self.request_id = new_request_id("cmpl")
        self.head = ChunkHead(self.request_id, now(), slot.id, wants_usage(req)) \
            if req.stream else None

    def groups(self, inputs: list[PromptInput], sampling: SamplingRequest, candidates: int,
               logprobs: int) -> list[list[CompletionChoice]]:
        req = self.req
        # The prompt's scores: with echo and logprobs (or max_tokens 0, which
        # the engine serves only as scoring). The first candidate asks; the
        # others take the prompt from the prefix cache, unless nothing is
        # generated and each must score it.
        scoring = req.echo and (logprobs >= 0 or req.max_tokens == 0)
        seed = None
        if candidates > 1:
            seed = resolve_seed(req.seed, self.app[MANAGER].sampling_defaults(self.slot))
        groups = []
        for prompt_index, prompt in enumerate(inputs):
            group: list[CompletionChoice] = []
            for i in range(candidates):
                asked = sampling
                if seed is not None:
                    asked = replace(asked, seed=sibling_seed(seed, i))
                if scoring and (i == 0 or req.max_tokens == 0):
                    asked = replace(asked, prompt_logprobs=max(logprobs, 0))
                request_id = self.request_id if prompt_index == i == 0 \
                    else f"{self.request_id}-{prompt_index}-{i}"
                generation = start_generation(self.app, self.slot, self.engine, self.text, asked,
                                              prompt.ids, request_id, grammar=self.grammar)
                group.append(CompletionChoice(
                    generation, prompt, index=prompt_index * candidates + i,
                    scorer=group[0].generation if group else generation,
                    echo=req.echo, texts=self.texts, head=self.head))
            groups.append(group)
        return groups


async def _collect(groups: list[list[CompletionChoice]]) -> None:
    try:
        if len(groups) == 1 and len(groups[0]) == 1:
            await groups[0][0].collect()
        else:
            await run_siblings([[Sibling(c.generation, c.collect) for c in group]
                                for group in groups])
    except EngineFailure as exc:
        raise engine_error(exc) from None


def _best(groups: list[list[CompletionChoice]], n: int) -> list[CompletionChoice]:
    """Each prompt's n choices: all of them, or best_of's n most likely."""
    chosen = []
    for prompt_index, group in enumerate(groups):
        if len(group) > n:
            group = sorted(group, key=lambda choice: choice.score, reverse=True)[:n]
            for rank, choice in enumerate(group):
                choice.index = prompt_index * n + rank
        chosen.extend(group)
    return chosen


def _usage(groups: list[list[CompletionChoice]]) -> dict[str, Any]:
    """Each prompt counted once; every generated token, best_of's discarded
    candidates too (they were generated), as OpenAI counts them."""
    prompt = sum(group[0].generation.prompt_tokens for group in groups)
    completion = sum(c.generation.completion_tokens for group in groups for c in group)
    cached = sum(group[0].generation.cached_tokens for group in groups)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _stream(request: web.Request, groups: list[list[CompletionChoice]],
                  include_usage: bool) -> web.StreamResponse:
    first = groups[0][0]
    assert first.head is not None
    head = first.head

    def usage_chunk() -> dict[str, Any]:
        body = head.body([])
        body["usage"] = _usage(groups)
        return body

    if len(groups) == 1 and len(groups[0]) == 1:
        return await stream_generation(request, first.generation, first,
                                       usage_chunk=usage_chunk if include_usage else None)
    return await _stream_several(request, groups, usage_chunk if include_usage else None)


async def _stream_several(request: web.Request, groups: list[list[CompletionChoice]],
                          usage_chunk: Any) -> web.StreamResponse:
    """Every choice's chunks interleaved as they come, each chunk about one
    choice, a finish chunk per choice, then the usage chunk and [DONE]."""
    response = await open_event_stream(request)
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    def sibling(choice: CompletionChoice) -> Sibling:
        async def run() -> None:
            async for item in choice.generation.stream():
                if isinstance(item, Piece):
                    data = choice.piece_data(item)
                    if data:
                        outbox.put_nowait(data)
            outbox.put_nowait(choice.finish_data())

        return Sibling(choice.generation, run)

    choices = [choice for group in groups for choice in group]
    try:
        opening = b"".join(choice.opening() for choice in choices)
        if opening:
            await response.write(opening)
        failure = await stream_siblings(response, [[sibling(c) for c in group] for group in groups],
                                        outbox)
        if failure is not None:
            await send_data(response, openai_error_body(engine_error(failure)))
        elif usage_chunk is not None:
            await send_data(response, usage_chunk())
        await send_done(response)
    except ConnectionResetError:
        pass  # the client left: stream_siblings aborted the choices
    finally:
        for choice in choices:
            choice.generation.close()
    return response
