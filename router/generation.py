"""One request's generation as the HTTP layer sees it: text pieces, prompt
progress, usage and timings.

Token ids arrive from the engine step by step; this turns them into text with
the incremental detokenizer, applies stop strings (withholding the matched
text and aborting the engine request), and keeps the counts and clocks that
usage, timings and finish reasons report. The engine reports a stop *token*
as generated (it is counted) but its text is never shown.

A streamed answer may have its items made and sent in the engine reader's
pass instead (push_items): the same items, in the same order, without a
wake-up of its handler for every engine step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protocol import ImageInput, RequestOutput, SamplingParams, TokenLogprobs
from router.engine_client import EngineClient, EngineFailure, RequestStream
from router.observability.records import RequestRecord, current_record
from router.output_budget import check_prompt
from router.text.detokenizer import IncrementalDetokenizer
from router.text.model_text import ModelText
from router.text.stop_strings import StopStringMatcher


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_context(prompt_ids: Sequence[int], max_context: int, param: str = "messages") -> None:
    """OpenAI's context_length_exceeded error when the prompt leaves no room
    for even one generated token (router/output_budget.py has the rest)."""
    check_prompt(len(prompt_ids), max_context, param)


@dataclass(frozen=True)
class GenerationInput:
    prompt_ids: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True
    # llama.cpp's id_slot: the engine lane the request runs in (-1: any).
    id_slot: int = -1
    # The prompt's images at their offsets (router/media/placement.py).
    images: Sequence[ImageInput] = ()


@dataclass(frozen=True, slots=True)
class Piece:
    """What one engine step added: its tokens and the text they complete
    (empty while a character or a possible stop string is held back), and
    with SamplingParams.logprobs the log probabilities of its shown tokens
    (a stop token that ended the generation is neither shown nor scored)."""

    text: str
    token_ids: list[int]
    logprobs: Sequence[TokenLogprobs] = ()


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """Prompt processing so far (SamplingParams.report_progress)."""

    processed: int
    total: int
    cached: int


class Generation:
    def __init__(self, client: EngineClient, text: ModelText, request_id: str, spec: GenerationInput):
        self.client = client
        self.text = text
        self.request_id = request_id
        self.spec = spec
        self.prompt_tokens = len(spec.prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        # Speculative decoding: draft tokens verified for it, and accepted.
        self.draft_tokens = 0
        self.draft_accepted = 0
        self.token_ids: list[int] = []
        # With SamplingParams.logprobs: those of the shown generated tokens;
        # with prompt_logprobs: those of the prompt tokens after the first.
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        # Set when a stop token (end of sequence, stop_token_ids) ended it;
        # with logprobs, its log probabilities (llama.cpp reports them).
        self.stop_token: int | None = None
        self.stop_token_logprobs: TokenLogprobs | None = None
        self._stream: RequestStream | None = None
        # Outputs of the batch in hand not yet turned into items.
        self._outputs_left = 0
        # Set when stream() starts: the request's record, detokenizer and stop matcher.
        self._record: RequestRecord | None = None
        self._detokenizer: IncrementalDetokenizer | None = None
        self._matcher: StopStringMatcher | None = None
        # push_items' (ready, send), and what failed in the reader's pass.
        self._push: tuple[Callable[[], bool], Callable[[Piece | PromptProgress], None]] | None = None
        self._push_failure: Exception | None = None
        self._started = 0.0
        self._first_token = 0.0
        self._ended = 0.0
        # Set once the engine holds the whole prompt's KV (its first token
        # came, or the request ended): siblings of the same prompt submitted
        # after it find the prompt's full pages in the prefix cache.
        self.prefilled = asyncio.Event()
        params = spec.params
        self._hidden_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(text.eos_token_ids)
        )

    async def stream(self) -> AsyncIterator[Piece | PromptProgress]:
        """Pieces as they are produced (and prompt progress when asked for);
        finish_reason is set at the end. Raises EngineFailure when the engine
        refuses the request or dies."""
        spec = self.spec
        self._started = time.perf_counter()
        self._record = record = current_record.get()
        if record is not None:
            record.engine_request_id = self.request_id
            record.prompt_tokens = self.prompt_tokens
        if spec.images:
            stream = self.client.submit(self.request_id, spec.prompt_ids, spec.params, spec.id_slot,
                                        images=spec.images)
        else:
            stream = self.client.submit(self.request_id, spec.prompt_ids, spec.params, spec.id_slot)
        self._stream = stream
        self._detokenizer = IncrementalDetokenizer(
            self.text.tokenizer, spec.prompt_ids, skip_special_tokens=spec.skip_special_tokens
        )
        self._matcher = StopStringMatcher(spec.stop)
        if self._push is not None:
            stream.listen(self._pushed)
        try:
            # Outputs come in batches (all that arrived since the last look):
            # one wake-up of this task per batch, not per engine step.
            while True:
                outputs = await stream.take()
                if self._push_failure is not None:
                    raise self._push_failure
                if not outputs:
                    return
                left = len(outputs)
                for output in outputs:
                    left -= 1
                    self._outputs_left = left
                    yield self._next_item(output)
                    if self.finish_reason is not None:
                        return
        except EngineFailure as exc:
            if record is not None:
                # A stream that already answered 200 still failed.
                record.outcome, record.error_code = "error", exc.code
            raise
        finally:
            self.prefilled.set()

    def push_items(self, ready: Callable[[], bool],
                   send: Callable[[Piece | PromptProgress], None]) -> None:
        """Have the engine reader's pass make this generation's items and
        send(item) them, whenever stream()'s consumer waits for its next item
        with nothing queued and ready() says send can take one at once: a
        streamed answer then costs no wake-up of its handler per engine step.
        stream() yields the items made otherwise, and ends when a sent item
        ends the generation; what send raises, stream() raises. Call before
        stream() starts."""
        self._push = (ready, send)

    def _pushed(self, output: RequestOutput) -> bool:
        """The stream's listener (in the reader's pass): whether it took the output."""
        assert self._push is not None and self._stream is not None
        ready, send = self._push
        if not ready():
            return False
        try:
            send(self._next_item(output))
        except Exception as exc:
            # Raised in the consumer's task, where it would have been raised
            # had the consumer made the item; the output is not made again.
            self._push_failure = exc
            self._stream.listen(None)
            return False
        return True

    def _next_item(self, output: RequestOutput) -> Piece | PromptProgress:
        """What one engine output adds; sets finish_reason when it ends the generation."""
        stream, detokenizer, matcher, record = (self._stream, self._detokenizer, self._matcher,
                                                self._record)
        assert stream is not None and detokenizer is not None and matcher is not None
        self.cached_tokens = output.num_cached_tokens
        if output.cache_hits is not None and record is not None:
            record.report_cache_hits(output.cache_hits)
        if output.prompt_logprobs:
            self.prompt_logprobs.extend(output.prompt_logprobs)
        ids = output.token_ids
        if not ids and output.finish_reason is None:
            return PromptProgress(output.num_computed_tokens, self.prompt_tokens, self.cached_tokens)
        self.prefilled.set()
        if ids and not self._first_token:
            self._first_token = time.perf_counter()
        visible = ids
        logprobs = output.logprobs
        if output.finish_reason == "stop" and ids and ids[-1] in self._hidden_ids:
            self.stop_token = ids[-1]
            visible = ids[:-1]
            if len(logprobs) == len(ids):
                self.stop_token_logprobs = logprobs[-1]
            logprobs = logprobs[:len(visible)]
        piece, matched, used = self._match_stops(visible, output.finish_reason is not None)
        if matched is not None and used < len(ids):
            # A verify step's tokens after the stop string were never part of
            # the answer: not counted, not reported (as decoding them one at
            # a time would have stopped there).
            ids, visible, logprobs = ids[:used], visible[:used], logprobs[:used]
            self.stop_token = None
            self.stop_token_logprobs = None
        if record is not None:
            record.cached_tokens = self.cached_tokens
            if ids:
                record.add_tokens(len(ids))
        self.completion_tokens += len(ids)
        self.draft_tokens += output.num_draft_tokens
        self.draft_accepted += output.num_draft_accepted
        self.token_ids.extend(ids)
        if logprobs:
            self.logprobs.extend(logprobs)
        if matched is not None:
            self._finish("stop")
            self.stop_string = matched
            stream.abort()
            return Piece(piece, ids, logprobs)
        if output.finish_reason is not None:
            self._finish(output.finish_reason)
            return Piece(piece + matcher.flush(), ids, logprobs)
        return Piece(piece, ids, logprobs)

    def _match_stops(self, visible: list[int], last: bool) -> tuple[str, str | None, int]:
        """Detokenize visible tokens and look for a stop string: (text safe
        to emit, the stop string met or None, how many of the tokens it
        took). Several tokens (a verify step's) go one at a time while stop
        strings are set, so a match tells which token completed it."""
        detokenizer, matcher = self._detokenizer, self._matcher
        assert detokenizer is not None and matcher is not None
        if len(visible) <= 1 or not matcher.stops:
            new_text = detokenizer.add(visible)
            if last:
                new_text += detokenizer.flush()
            piece, matched = matcher.feed(new_text)
            return piece, matched, len(visible)
        pieces: list[str] = []
        for index, token in enumerate(visible):
            new_text = detokenizer.add([token])
            if last and index == len(visible) - 1:
                new_text += detokenizer.flush()
            piece, matched = matcher.feed(new_text)
            pieces.append(piece)
            if matched is not None:
                return "".join(pieces), matched, index + 1
        return "".join(pieces), None, len(visible)

    @property
    def output_waiting(self) -> bool:
        """Whether stream() has its next item at hand: it will come without
        waiting for the engine. A consumer that fell behind may then hold
        what it has to send and send it together with what follows."""
        if self.finish_reason is not None:
            return False
        stream = self._stream
        return self._outputs_left > 0 or (stream is not None and stream.has_output)

    async def pieces(self) -> AsyncIterator[str]:
        """Only the new text, for callers that need nothing else."""
        async for item in self.stream():
            if isinstance(item, Piece) and item.text:
                yield item.text

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        # The record stream() found (this may run in the engine reader's pass).
        record = self._record
        if record is not None:
            record.finish_reason = reason
        self._ended = time.perf_counter()
        if not self._first_token:
            self._first_token = self._ended

    def close(self) -> None:
        """Abort the engine request unless it already finished (a client that
        went away, or an error in the handler)."""
        if self._stream is not None:
            self._stream.abort()

    async def collect(self) -> str:
        try:
            return "".join([piece async for piece in self.pieces()])
        finally:
            self.close()

    def timings(self) -> dict[str, Any]:
        """llama.cpp's timings object: the prompt phase runs from submission to
        the first generated token, the generation phase from there to the end."""
        now = time.perf_counter()
        first = self._first_token or now
        prompt_ms = (first - self._started) * 1000 if self._started else 0.0
        predicted_ms = ((self._ended or now) - first) * 1000
        prompt_n = self.prompt_tokens - self.cached_tokens
        predicted_n = self.completion_tokens
        # llama-server adds draft_n and draft_n_accepted only when it drafted.
        drafts = ({"draft_n": self.draft_tokens, "draft_n_accepted": self.draft_accepted}
                  if self.draft_tokens else {})
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1000 / prompt_ms if prompt_ms else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            # One token ends the prompt phase and has no generation time of its own.
            "predicted_per_second":
                predicted_n * 1000 / predicted_ms if predicted_ms and predicted_n > 1 else 0.0,
            **drafts,
        }
