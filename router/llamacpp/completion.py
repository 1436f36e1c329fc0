"""POST /completion (and /completions): llama.cpp's native text completion.

The prompt is tokenized before the model is leased (the text side needs no
engine), the request is checked against the loaded model's context, and the
answer is one JSON object or, with `stream`, server-sent events with no
`[DONE]`: a chunk per token, prompt progress chunks first with
`return_progress`, and a last chunk with `stop: true` and the statistics.
With `n_probs`, tokens come with their probabilities (router/llamacpp/responses.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from protocol import GrammarSpec, ImageInput
from router.capabilities import require_vision
from router.engine_client import EngineFailure
from router.errors import ContextLengthExceeded
from router.generation import Generation, GenerationInput, PromptProgress, new_request_id
from router.http.errors import as_api_error, decode_body, engine_error, invalid, llamacpp_error_body
from router.http.keys import IMAGES, MANAGER
from router.http.sse import (
    EventStream,
    StreamingLease,
    StreamOpenedError,
    open_event_stream,
    send_data,
)
from router.lifecycle import ModelManager, ModelSlot
from router.llamacpp.grammar import grammar_spec, prepare_engine
from router.llamacpp.params import CompletionSettings, completion_settings, generation_settings
from router.llamacpp.probabilities import ProbabilityWriter
from router.llamacpp.prompt import completion_prompt, prompt_images, prompt_parts
from router.llamacpp.responses import CompletionReport
from router.llamacpp.schemas import CompletionRequest
from router.openai.common import autoload
from router.sampling import build_params
from router.supervisor import EngineProcess
from router.text.model_text import ModelText

# Builds a request's prompt ids once its model is leased (its context known).
PromptBuilder = Callable[[ModelSlot], list[int]]


def _check_prompt(ids: list[int], slot: ModelSlot) -> int:
    """The room left for output; llama.cpp's error when there is none."""
    assert slot.ready is not None
    n_vocab = slot.ready.model.n_vocab
    bad = next((t for t in ids if t >= n_vocab), None)
    if bad is not None:
        raise invalid(f"token id {bad} in 'prompt' is outside the vocabulary (0..{n_vocab - 1})",
                      "prompt")
    n_ctx = slot.max_context
    if len(ids) >= n_ctx:
        # Rendered as llama.cpp's exceed_context_size_error, n_prompt_tokens and n_ctx beside.
        raise ContextLengthExceeded(
            f"the request exceeds the available context size: {len(ids)} prompt tokens, the "
            f"context holds {n_ctx} (prompt and output together)",
            n_prompt_tokens=len(ids), n_ctx=n_ctx, param="prompt")
    return n_ctx - len(ids)


def _start(manager: ModelManager, slot: ModelSlot, engine: EngineProcess, text: ModelText,
           ids: list[int], settings: CompletionSettings,
           grammar: GrammarSpec | None, extra_eos: tuple[int, ...], id_slot: int = -1,
           images: tuple[ImageInput, ...] = ()) -> Generation:
    room = _check_prompt(ids, slot)
    n_predict = settings.n_predict
    # n_predict 0 evaluates the prompt into the cache: the engine computes one
    # token (it needs at least one), which is never shown.
    max_tokens = room if n_predict < 0 else min(max(n_predict, 1), room)
    if grammar is not None:
        prepare_engine(engine, text)
    params = build_params(settings.sampling, max_tokens=max_tokens,
                          defaults=manager.sampling_defaults(slot),
                          eos_token_ids=text.eos_token_ids + extra_eos, grammar=grammar,
                          n_vocab=slot.ready.model.n_vocab if slot.ready is not None else None)
    spec = GenerationInput(ids, params, settings.sampling.stop, id_slot=id_slot, images=images)
    return Generation(engine.client, text, new_request_id("cmpl"), spec)


async def completion(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), CompletionRequest)
    settings = completion_settings(req)
    grammar = grammar_spec(req)
    parts = prompt_parts(req.prompt)

    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    require_vision(prompt_images(parts), slot.entry)
    text = await manager.text_for(slot)
    ids, images = await completion_prompt(parts, text, slot.entry.vision, request.app[IMAGES])
    return await serve_completion(request, req, slot, text, lambda _: ids, settings, grammar,
                                  images=images)


async def serve_completion(request: web.Request, req: CompletionRequest, slot: ModelSlot,
                           text: ModelText, build_prompt: PromptBuilder,
                           settings: CompletionSettings, grammar: GrammarSpec | None,
                           extra_eos: tuple[int, ...] = (),
                           images: tuple[ImageInput, ...] = ()) -> web.StreamResponse:
    """/completion's generation path, shared with /infill: lease the model,
    build the prompt, generate, answer in llama.cpp's shape. `extra_eos`
    are more token ids that end the generation; `images` the prompt's
    images at their offsets (router/media/placement.py)."""
    manager = request.app[MANAGER]
    built: list[list[int]] = []

    def admit(loaded: ModelSlot) -> None:
        # Built and checked once the model is loaded and before the wait for
        # a lane: an impossible request is answered at once however busy.
        built.append(build_prompt(loaded))
        _check_prompt(built[-1], loaded)

    lease = manager.lease(slot, autoload=autoload(request), on_admit=admit)
    if req.stream:
        lease = StreamingLease(lease, lambda: open_event_stream(request), _send_error)
    try:
        async with lease as engine:
            ids = built[-1]
            generation = _start(manager, slot, engine, text, ids, settings, grammar, extra_eos,
                                req.id_slot, images)
            report = CompletionReport(
                generation=generation,
                model=slot.id,
                # id_slot pins the request to that engine lane (llama.cpp's
                # slot); unpinned, the lane it gets is not known here.
                id_slot=max(req.id_slot, 0),
                settings=generation_settings(req, settings, generation.spec.params,
                                         manager.sampling_defaults(slot).seed),
                prompt=text.tokenizer.decode(ids, skip_special_tokens=False),
                stream=req.stream,
                return_tokens=req.return_tokens,
                timings_per_token=req.timings_per_token,
                response_fields=req.response_fields or (),
                prompt_only=settings.n_predict == 0,
                probabilities=(ProbabilityWriter(text.tokenizer, req.post_sampling_probs)
                               if req.n_probs > 0 else None),
            )
            if req.stream:
                return await _stream(request, report)
            try:
                content = await generation.collect()
            except EngineFailure as exc:
                raise engine_error(exc) from None
    except StreamOpenedError as opened:
        return opened.response
    if report.prompt_only:
        content = ""
    return web.json_response(report.final(content, "\n" in content))


async def _send_error(response: EventStream, exc: Exception) -> None:
    """A refusal after the stream opened (a long wait for admission)."""
    await send_data(response, llamacpp_error_body(as_api_error(exc)))


async def _stream(request: web.Request, report: CompletionReport) -> web.StreamResponse:
    """Token chunks (after progress chunks when asked for) and the last chunk
    with the statistics. An engine failure mid-stream becomes an error event;
    a client that leaves aborts the engine request."""
    generation = report.generation
    response = await open_event_stream(request)
    started = time.perf_counter()
    has_new_line = False
    try:
        try:
            async for item in generation.stream():
                if isinstance(item, PromptProgress):
                    elapsed_ms = int((time.perf_counter() - started) * 1000)
                    await send_data(response, report.progress(item, elapsed_ms))
                elif not report.prompt_only and (item.token_ids or item.text):
                    has_new_line = has_new_line or "\n" in item.text
                    await send_data(response, report.partial(item))
        except EngineFailure as exc:
            await send_data(response, llamacpp_error_body(engine_error(exc)))
        else:
            await send_data(response, report.final("", has_new_line))
    except ConnectionResetError:
        pass  # the client left; close() below aborts the engine request
    finally:
        generation.close()
    return response
