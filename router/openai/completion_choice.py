"""One choice of a Completions request: its text (after the echoed prompt)
and log probabilities, as a whole body or as streamed chunks.

Streamed, a chunk carries the logprobs of the tokens scored since the last
chunk that carried some: tokens whose text the detokenizer or the stop
matcher holds back bring their entries with the text, and the finish chunk
brings those left. With echo and logprobs the echo chunk waits for the
prompt's scores, which the engine sends before the first generated token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from router.build_info import build_fingerprint
from router.generation import Generation, Piece
from router.http.sse import data_event, text_event_encoder
from router.openai.logprobs import CompletionLogprobs, TokenTexts, joined


@dataclass(frozen=True)
class PromptInput:
    ids: list[int]
    # The text echoed back before the completion ("" without echo).
    echo: str


@dataclass(frozen=True)
class ChunkHead:
    """What every streamed chunk of one response repeats."""

    id: str
    created: int
    model: str
    include_usage: bool

    def body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": build_fingerprint(),
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return body


class CompletionChoice:
    def __init__(self, generation: Generation, prompt: PromptInput, *, index: int,
                 scorer: Generation, echo: bool, texts: TokenTexts | None,
                 head: ChunkHead | None = None):
        self.generation = generation
        self.prompt = prompt
        # The prompt's first choice, whose engine request scored the prompt
        # (its siblings' prompts come from the prefix cache, unscored).
        self.scorer = scorer
        self.echo = echo
        self.logprobs = CompletionLogprobs(texts) if texts is not None else None
        self.head = head
        # prompt_index * n + i; best_of sets it again once the candidates are ranked.
        self.index = index
        # The whole text, once collect() ends (not streamed).
        self.text = ""
        self._echo_due = echo
        self._scored_sent = 0
        self._text_event = text_event_encoder(lambda text: self.chunk(text, None, None)) \
            if head is not None and self.logprobs is None else None

    async def collect(self) -> None:
        self.text = await self.generation.collect()

    @property
    def score(self) -> float:
        """best_of's measure: the mean log probability of the shown tokens
        (OpenAI's "highest log probability per token"); an empty answer ranks last."""
        scored = self.generation.logprobs
        if not scored:
            return -math.inf
        return sum(entry.logprob for entry in scored) / len(scored)

    def _prompt_part(self) -> dict[str, list[Any]]:
        assert self.logprobs is not None
        part = self.logprobs.prompt_part(self.prompt.ids, self.scorer.prompt_logprobs)
        # The generated tokens' offsets count from the end of the echoed text.
        self.logprobs.restart_at(len(self.prompt.echo))
        return part

    def _generated_part(self, start: int, end: int) -> dict[str, list[Any]]:
        assert self.logprobs is not None
        generation = self.generation
        return self.logprobs.part(generation.token_ids[start:end], generation.logprobs[start:end])

    def body(self) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            parts = [self._prompt_part()] if self.echo else []
            parts.append(self._generated_part(0, len(self.generation.logprobs)))
            logprobs = joined(parts)
        return {"text": self.prompt.echo + self.text, "index": self.index, "logprobs": logprobs,
                "finish_reason": self.generation.finish_reason}

    # ---- streamed ----

    def chunk(self, text: str, finish_reason: str | None,
              logprobs: dict[str, list[Any]] | None) -> dict[str, Any]:
        assert self.head is not None
        return self.head.body([{"text": text, "index": self.index, "logprobs": logprobs,
                                "finish_reason": finish_reason}])

    def _echo_data(self) -> bytes:
        if not self._echo_due:
            return b""
        self._echo_due = False
        logprobs = self._prompt_part() if self.logprobs is not None else None
        return data_event(self.chunk(self.prompt.echo, None, logprobs))

    def opening(self) -> bytes:
        """The echo chunk, unless it waits for the prompt's scores."""
        return b"" if self.logprobs is not None else self._echo_data()

    def _unsent_logprobs(self) -> dict[str, list[Any]] | None:
        if self.logprobs is None:
            return None
        start, end = self._scored_sent, len(self.generation.logprobs)
        if start == end:
            return None
        self._scored_sent = end
        return self._generated_part(start, end)

    def piece_data(self, piece: Piece) -> bytes:
        """The chunk of a piece with text (b"" for one without)."""
        echo = self._echo_data()
        if not piece.text:
            return echo
        if self._text_event is not None:
            return echo + self._text_event(piece.text)
        return echo + data_event(self.chunk(piece.text, None, self._unsent_logprobs()))

    def finish_data(self) -> bytes:
        """The chunk with the finish reason (and llama.cpp's timings)."""
        echo = self._echo_data()
        final = self.chunk("", self.generation.finish_reason, self._unsent_logprobs())
        final["timings"] = self.generation.timings()
        return echo + data_event(final)
