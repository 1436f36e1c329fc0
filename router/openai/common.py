"""What the Chat Completions and Completions handlers share: resolving the
model, checking the prompt against the context, building the generation, and
the usage object."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from protocol import GrammarSpec
from router.engine_client import EngineFailure
from router.generation import Generation, GenerationInput, Piece, PromptProgress, check_context
from router.http.errors import as_api_error, engine_error, openai_error_body
from router.http.keys import MANAGER
from router.http.sse import (
    EventStream,
    HeldEvents,
    StreamingLease,
    open_event_stream,
    send_data,
    send_done,
    text_event_encoder,
)
from router.lifecycle import ModelSlot
from router.observability.records import current_record
from router.openai.params import (
    build_sampling,
    check_max_tokens,
    stop_strings,
)
from router.openai.schemas import SamplingFields
from router.output_budget import output_budget
from router.supervisor import EngineProcess
from router.text.model_text import ModelText


def autoload(request: web.Request) -> bool:
    """?autoload=0|1 overrides the server's --no-models-autoload per request."""
    value = request.query.get("autoload")
    if value is None:
        return request.app[MANAGER].config.autoload
    return value.lower() in ("1", "true", "yes", "on")


def start_generation(
    app: web.Application,
    slot: ModelSlot,
    engine: EngineProcess,
    text: ModelText,
    req: SamplingFields,
    prompt_ids: list[int],
    request_id: str,
    max_tokens: int | None,
    max_tokens_field: str,
    grammar: GrammarSpec | None = None,
) -> Generation:
    check_max_tokens(max_tokens, max_tokens_field)
    check_context(prompt_ids, slot.max_context, "prompt")
    manager = app[MANAGER]
    params = build_sampling(
        req,
        max_tokens=output_budget(slot.max_context, len(prompt_ids), max_tokens,
                                 manager.config.default_max_tokens),
        defaults=manager.sampling_defaults(slot),
        eos_token_ids=text.eos_token_ids,
        grammar=grammar,
        n_vocab=slot.ready.model.n_vocab if slot.ready is not None else None,
    )
    if grammar is not None:
        from router.text.grammar_vocab import grammar_vocab

        engine.client.send_vocab_once(lambda: grammar_vocab(text))
    spec = GenerationInput(prompt_ids, params, stop_strings(req.stop), req.skip_special_tokens)
    return Generation(engine.client, text, request_id, spec)


async def send_stream_error(response: EventStream, exc: Exception) -> None:
    """An OpenAI stream's refusal after its headers went out: an error chunk, then [DONE]."""
    error = as_api_error(exc)
    record = current_record.get()
    if record is not None:
        record.outcome, record.error_code = "error", error.code
    await send_data(response, openai_error_body(error))
    await send_done(response)


def streaming_lease(request: web.Request, lease: Any) -> Any:
    """A streamed request's lease: its stream opens (and is kept alive) when
    admission takes a while; a refusal then is an error chunk."""
    return StreamingLease(lease, lambda: open_event_stream(request), send_stream_error)


def wants_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def collect(generation: Generation) -> str:
    """The whole answer of a non-streamed request; engine failures become API errors."""
    try:
        return await generation.collect()
    except EngineFailure as exc:
        raise engine_error(exc) from None


def usage(generation: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": generation.cached_tokens},
    }


def now() -> int:
    return int(time.time())


# (text piece or None, finish_reason or None) -> one streamed chunk body.
ChunkMaker = Callable[[str | None, str | None], dict[str, Any]]


async def stream_generation(
    request: web.Request,
    generation: Generation,
    make_chunk: ChunkMaker,
    *,
    opening: list[dict[str, Any]],
    include_usage: bool,
) -> web.StreamResponse:
    """Send a generation as server-sent events, OpenAI style: the opening
    chunks, one chunk per text piece, a chunk with the finish reason, the usage
    chunk when asked for, then [DONE]. An engine failure mid-stream becomes an
    error event; a client that leaves aborts the engine request."""
    response = await open_event_stream(request)
    piece_event = text_event_encoder(lambda text: make_chunk(text, None))

    def send_now(item: Piece | PromptProgress) -> None:
        if isinstance(item, Piece) and item.text:
            response.write_now(piece_event(item.text))

    # While the response takes writes at once, the engine reader's pass sends
    # the pieces (Generation.push_items); the loop below sends the others.
    generation.push_items(response.can_write_now, send_now)
    # Events held while the next item is already at hand (HeldEvents).
    held = HeldEvents(response)
    try:
        for body in opening:
            await send_data(response, body)
        try:
            async for item in generation.stream():
                if isinstance(item, Piece) and item.text:
                    held.add(piece_event(item.text))
                if held and not generation.output_waiting:
                    await held.send()
        except EngineFailure as exc:
            await held.send()
            await send_data(response, openai_error_body(engine_error(exc)))
        else:
            await held.send()
            final = make_chunk(None, generation.finish_reason)
            final["timings"] = generation.timings()
            await send_data(response, final)
            if include_usage:
                final = make_chunk(None, None)
                final["choices"] = []
                final["usage"] = usage(generation)
                await send_data(response, final)
        await send_done(response)
    except ConnectionResetError:
        pass  # the client left; close() below aborts the engine request
    finally:
        generation.close()
    return response
