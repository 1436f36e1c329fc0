"""What the Chat Completions and Completions handlers share: resolving the
model, checking the prompt against the context, building the generation, and
streaming one choice."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

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
)
from router.lifecycle import ModelSlot
from router.observability.records import current_record
from router.openai.schemas import SamplingFields
from router.output_budget import output_budget
from router.sampling import SamplingRequest, build_params
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
    sampling: SamplingRequest,
    prompt_ids: list[int],
    request_id: str,
    grammar: GrammarSpec | None = None,
) -> Generation:
    """A generation of prompt_ids (not yet submitted: its stream() submits
    it). max_tokens 0 only scores the prompt (sampling.prompt_logprobs)."""
    check_context(prompt_ids, slot.max_context, "prompt")
    manager = app[MANAGER]
    max_tokens = 0 if sampling.max_tokens == 0 else output_budget(
        slot.max_context, len(prompt_ids), sampling.max_tokens, manager.config.default_max_tokens)
    params = build_params(
        sampling,
        max_tokens=max_tokens,
        defaults=manager.sampling_defaults(slot),
        eos_token_ids=text.eos_token_ids,
        grammar=grammar,
        n_vocab=slot.ready.model.n_vocab if slot.ready is not None else None,
    )
    if grammar is not None:
        from router.text.grammar_vocab import grammar_vocab

        engine.client.send_vocab_once(lambda: grammar_vocab(text))
    spec = GenerationInput(prompt_ids, params, sampling.stop, sampling.skip_special_tokens)
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


def now() -> int:
    return int(time.time())


class StreamedChoice(Protocol):
    """One choice's streamed chunks, as data events (b"": nothing to send)."""

    def opening(self) -> bytes: ...

    def piece_data(self, piece: Piece) -> bytes: ...

    def finish_data(self) -> bytes: ...


async def stream_generation(
    request: web.Request,
    generation: Generation,
    choice: StreamedChoice,
    *,
    usage_chunk: Callable[[], dict[str, Any]] | None,
) -> web.StreamResponse:
    """Send one generation as server-sent events, OpenAI style: the choice's
    opening, a chunk per text piece, its finish chunk, the usage chunk when
    asked for, then [DONE]. An engine failure mid-stream becomes an error
    event; a client that leaves aborts the engine request."""
    response = await open_event_stream(request)

    def send_now(item: Piece | PromptProgress) -> None:
        if isinstance(item, Piece):
            data = choice.piece_data(item)
            if data:
                response.write_now(data)

    # While the response takes writes at once, the engine reader's pass sends
    # the pieces (Generation.push_items); the loop below sends the others.
    generation.push_items(response.can_write_now, send_now)
    # Events held while the next item is already at hand (HeldEvents).
    held = HeldEvents(response)
    try:
        opening = choice.opening()
        if opening:
            await response.write(opening)
        try:
            async for item in generation.stream():
                if isinstance(item, Piece):
                    data = choice.piece_data(item)
                    if data:
                        held.add(data)
                if held and not generation.output_waiting:
                    await held.send()
        except EngineFailure as exc:
            await held.send()
            await send_data(response, openai_error_body(engine_error(exc)))
        else:
            await held.send()
            await response.write(choice.finish_data())
            if usage_chunk is not None:
                await send_data(response, usage_chunk())
        await send_done(response)
    except ConnectionResetError:
        pass  # the client left; close() below aborts the engine request
    finally:
        generation.close()
    return response
