"""POST /v1/chat/completions: tools, reasoning, timings, log probabilities
and n choices (router/openai/choices.py) included.

Log probabilities cover every generated token the answer shows, whether the
parsers make it reasoning_content, content or a tool call (as vLLM does); a
stop token that ends the answer is neither shown nor scored.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from router.build_info import build_fingerprint
from router.chat.events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallStart,
)
from router.chat.turn import PreparedTurn, TurnRun, prepare_turn, start_turn
from router.engine_client import EngineFailure
from router.generation import Piece, PromptProgress, new_request_id
from router.http.errors import decode_body, engine_error, openai_error_body
from router.http.keys import IMAGES, MANAGER
from router.http.sse import (
    HeldEvents,
    StreamOpenedError,
    data_event,
    open_event_stream,
    send_data,
    send_done,
    text_event_encoder,
)
from router.lifecycle import ModelManager
from router.openai.chat_request import chat_request
from router.openai.choices import Sibling, run_siblings, sibling_seed, stream_siblings
from router.openai.common import autoload, now, streaming_lease, wants_usage
from router.openai.logprobs import ChatLogprobs, TokenTexts
from router.openai.params import check_choices
from router.openai.schemas import ChatCompletionRequest
from router.sampling import resolve_seed
from router.supervisor import EngineProcess
from router.text.token_pieces import pieces_for


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), ChatCompletionRequest)
    chat = chat_request(req)
    manager = request.app[MANAGER]
    n = req.n or 1
    check_choices(n, manager.config.max_choices)
    slot = manager.resolve(req.model)
    prepared = await prepare_turn(manager, slot, chat, request.app[IMAGES])
    lease = manager.lease(slot, autoload=autoload(request), on_admit=prepared.admit)
    if req.stream:
        lease = streaming_lease(request, lease)
    texts = TokenTexts(pieces_for(prepared.text.tokenizer)) if chat.sampling.logprobs >= 0 else None
    try:
        async with lease as engine:
            if n > 1:
                runs = _sibling_runs(manager, prepared, engine, n)
                if req.stream:
                    return await ChoicesStream(request, runs, slot.id, req, texts).send()
                await _run_all(runs)
                return web.json_response(completions_body(runs, slot.id, texts))
            run = start_turn(manager, prepared, engine, new_request_id("chatcmpl"))
            if req.stream:
                stream = ChatStream(request, run, slot.id, wants_usage(req),
                                    timings_per_token=bool(req.timings_per_token),
                                    logprobs=ChatLogprobs(texts) if texts else None)
                return await stream.send()
            try:
                await run.run_to_end()
            except EngineFailure as exc:
                raise engine_error(exc) from None
    except StreamOpenedError as opened:
        return opened.response
    return web.json_response(completion_body(run, slot.id, texts))


def _sibling_runs(manager: ModelManager, prepared: PreparedTurn, engine: EngineProcess,
                  n: int) -> list[TurnRun]:
    """n turns of one prompt, sampled with seeds seed, seed + 1, ... (the
    request's, else the server's, else a random one)."""
    request_id = new_request_id("chatcmpl")
    sampling = prepared.request.sampling
    seed = resolve_seed(sampling.seed, manager.sampling_defaults(prepared.slot))
    runs = []
    for index in range(n):
        turn = replace(sampling, seed=sibling_seed(seed, index))
        sibling = replace(prepared, request=replace(prepared.request, sampling=turn))
        # The engine's request ids differ; the response carries the first.
        runs.append(start_turn(manager, sibling, engine,
                               f"{request_id}-{index}" if index else request_id))
    return runs


async def _run_all(runs: list[TurnRun]) -> None:
    try:
        await run_siblings([[Sibling(run.generation, run.run_to_end) for run in runs]])
    except EngineFailure as exc:
        raise engine_error(exc) from None


def _logprobs(run: TurnRun, texts: TokenTexts | None) -> dict[str, Any] | None:
    if texts is None:
        return None
    generation = run.generation
    return ChatLogprobs.body(ChatLogprobs(texts).entries(generation.token_ids, generation.logprobs))


def _choice(run: TurnRun, index: int, texts: TokenTexts | None) -> dict[str, Any]:
    return {"index": index, "message": _message(run), "logprobs": _logprobs(run, texts),
            "finish_reason": run.finish_reason}


def _usage(runs: list[TurnRun]) -> dict[str, Any]:
    """The prompt counted once, the choices' tokens summed (as OpenAI counts n)."""
    usage = runs[0].usage()
    for run in runs[1:]:
        more = run.usage()
        usage["completion_tokens"] += more["completion_tokens"]
        usage["total_tokens"] += more["completion_tokens"]
        usage["completion_tokens_details"]["reasoning_tokens"] += \
            more["completion_tokens_details"]["reasoning_tokens"]
    return usage


def _message(run: TurnRun) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": run.content or None}
    if run.content == "" and not run.tool_calls:
        message["content"] = ""
    if run.reasoning:
        message["reasoning_content"] = run.reasoning
    if run.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in run.tool_calls
        ]
    return message


def completion_body(run: TurnRun, model: str, texts: TokenTexts | None = None) -> dict[str, Any]:
    return completions_body([run], model, texts)


def completions_body(runs: list[TurnRun], model: str, texts: TokenTexts | None) -> dict[str, Any]:
    """The response of n choices (timings are the first choice's)."""
    return {
        "id": runs[0].generation.request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": build_fingerprint(),
        "choices": [_choice(run, index, texts) for index, run in enumerate(runs)],
        "usage": _usage(runs),
        "timings": runs[0].generation.timings(),
    }


class ChatStream:
    """Server-sent chunks as OpenAI streams them: a role chunk, deltas of
    reasoning_content, content and tool_calls (a delta with the call's id and
    name, then pieces of its arguments), a finish chunk (with llama.cpp's
    timings), the usage chunk when asked for, then [DONE]."""

    def __init__(self, request: web.Request, run: TurnRun, model: str, include_usage: bool, *,
                 timings_per_token: bool = False, logprobs: ChatLogprobs | None = None,
                 index: int = 0, response_id: str | None = None):
        self.request = request
        self.run = run
        self.model = model
        self.include_usage = include_usage
        # llama.cpp's web UI asks for timings on every content chunk.
        self.timings_per_token = timings_per_token
        # With logprobs, a chunk carries the entries of the tokens scored
        # since the last chunk that carried some (text held back by the
        # detokenizer, the stop matcher or a parser brings its tokens'
        # entries with it), and the finish chunk those left.
        self.logprobs = logprobs
        self._scored_sent = 0
        # The choice this stream is about (n > 1 streams several) and the
        # response's id (its first choice's request id).
        self.index = index
        self.response_id = response_id or run.generation.request_id
        self.created = now()
        self.started = time.perf_counter()
        # The events of most chunks (text deltas), each encoded once as a template.
        self._content_event = text_event_encoder(lambda text: self.chunk({"content": text}))
        self._reasoning_event = text_event_encoder(
            lambda text: self.chunk({"reasoning_content": text}))

    def chunk(self, delta: dict[str, Any] | None, finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": build_fingerprint(),
            "choices": [] if delta is None else [
                {"index": self.index, "delta": delta, "logprobs": logprobs,
                 "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def _unsent_logprobs(self) -> dict[str, Any] | None:
        """The logprobs of the tokens scored since the last chunk that carried some."""
        if self.logprobs is None:
            return None
        generation = self.run.generation
        scored = generation.logprobs
        start, end = self._scored_sent, len(scored)
        if start == end:
            return None
        self._scored_sent = end
        return ChatLogprobs.body(self.logprobs.entries(generation.token_ids[start:end], scored[start:]))

    def finish_data(self) -> bytes:
        """The chunk with the finish reason (and llama.cpp's timings)."""
        final = self.chunk({}, self.run.finish_reason, self._unsent_logprobs())
        final["timings"] = self.run.generation.timings()
        return data_event(final)

    def delta(self, event: object) -> dict[str, Any] | None:
        if isinstance(event, ContentDelta):
            # Never an empty content delta: the role chunk opened the message.
            return {"content": event.text} if event.text else None
        if isinstance(event, ReasoningDelta):
            return {"reasoning_content": event.text}
        if isinstance(event, ToolCallStart):
            return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        if isinstance(event, ToolCallDelta):
            return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
        return None  # ToolCallEnd: nothing new to send

    def progress(self, progress: PromptProgress) -> dict[str, Any]:
        body = self.chunk(None)
        body["prompt_progress"] = {
            "total": progress.total, "cache": progress.cached, "processed": progress.processed,
            "time_ms": (time.perf_counter() - self.started) * 1000,
        }
        return body

    def event_data(self, event: object) -> bytes | None:
        """The data event that a turn event sends, or None when it sends nothing."""
        if isinstance(event, PromptProgress):
            return data_event(self.progress(event))
        if not self.timings_per_token and self.logprobs is None:
            # Text deltas, most chunks, from their templates (what delta() and chunk() make).
            if isinstance(event, ContentDelta):
                return self._content_event(event.text) if event.text else None
            if isinstance(event, ReasoningDelta):
                return self._reasoning_event(event.text)
        delta = self.delta(event)
        if delta is None:
            return None
        body = self.chunk(delta, logprobs=self._unsent_logprobs())
        if self.timings_per_token:
            body["timings"] = self.run.generation.timings()
        return data_event(body)

    async def send(self) -> web.StreamResponse:
        response = await open_event_stream(self.request)
        run = self.run
        try:
            # llama.cpp's opening chunk: the role, content null.
            await send_data(response, self.chunk({"role": "assistant", "content": None}))

            def send_now(item: Piece | PromptProgress) -> None:
                for event in run.events_of(item):
                    data = self.event_data(event)
                    if data is not None:
                        response.write_now(data)

            # While the response takes writes at once, the engine reader's
            # pass sends the events (Generation.push_items); the loop below
            # sends the others.
            run.generation.push_items(response.can_write_now, send_now)
            held = HeldEvents(response)
            try:
                async for event in run.events():
                    data = self.event_data(event)
                    if data is not None:
                        held.add(data)
                    if held and not run.generation.output_waiting:
                        await held.send()
            except EngineFailure as exc:
                await held.send()
                await send_data(response, openai_error_body(engine_error(exc)))
            else:
                await held.send()
                await response.write(self.finish_data())
                if self.include_usage:
                    usage = self.chunk(None)
                    usage["usage"] = run.usage()
                    await send_data(response, usage)
            await send_done(response)
        except ConnectionResetError:
            pass  # the client left; close() below aborts the engine request
        finally:
            run.generation.close()
        return response


class ChoicesStream:
    """n choices streamed together: each choice's role chunk, then the
    choices' chunks as they come (each chunk about one choice), a finish
    chunk per choice, the usage chunk when asked for (the prompt counted
    once, the choices' tokens summed), then [DONE]."""

    def __init__(self, request: web.Request, runs: list[TurnRun], model: str,
                 req: ChatCompletionRequest, texts: TokenTexts | None):
        self.request = request
        self.runs = runs
        self.include_usage = wants_usage(req)
        self.streams = [
            ChatStream(request, run, model, self.include_usage,
                       timings_per_token=bool(req.timings_per_token),
                       logprobs=ChatLogprobs(texts) if texts else None,
                       index=index, response_id=runs[0].generation.request_id)
            for index, run in enumerate(runs)
        ]

    async def send(self) -> web.StreamResponse:
        response = await open_event_stream(self.request)
        outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

        def sibling(stream: ChatStream) -> Sibling:
            async def run() -> None:
                async for event in stream.run.events():
                    data = stream.event_data(event)
                    if data is not None:
                        outbox.put_nowait(data)
                outbox.put_nowait(stream.finish_data())

            return Sibling(stream.run.generation, run)

        try:
            await response.write(b"".join(
                data_event(stream.chunk({"role": "assistant", "content": None}))
                for stream in self.streams))
            failure = await stream_siblings(response, [[sibling(s) for s in self.streams]], outbox)
            if failure is not None:
                await send_data(response, openai_error_body(engine_error(failure)))
            elif self.include_usage:
                usage = self.streams[0].chunk(None)
                usage["usage"] = _usage(self.runs)
                await send_data(response, usage)
            await send_done(response)
        except ConnectionResetError:
            pass  # the client left: stream_siblings aborted the choices
        finally:
            for run in self.runs:
                run.generation.close()
        return response
