"""One request's generation as the HTTP layer sees it: text pieces and usage.

Token ids arrive from the engine step by step; this turns them into text with
the incremental detokenizer, applies stop strings (withholding the matched
text and aborting the engine request), and keeps the counts that usage and
finish_reason report. The engine reports a stop *token* as generated (it is
counted) but its text is never shown.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from protocol import SamplingParams
from router.engine_client import EngineClient, RequestStream
from router.text.detokenizer import IncrementalDetokenizer
from router.text.model_text import ModelText
from router.text.stop_strings import StopStringMatcher


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class GenerationInput:
    prompt_ids: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True


class Generation:
    def __init__(self, client: EngineClient, text: ModelText, request_id: str, spec: GenerationInput):
        self.client = client
        self.text = text
        self.request_id = request_id
        self.spec = spec
        self.prompt_tokens = len(spec.prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self._stream: RequestStream | None = None
        params = spec.params
        self._hidden_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(text.eos_token_ids)
        )

    async def pieces(self) -> AsyncIterator[str]:
        """Yield new text as it is produced; finish_reason is set at the end.

        Raises EngineFailure when the engine refuses the request or dies.
        """
        spec = self.spec
        self._stream = stream = self.client.submit(self.request_id, spec.prompt_ids, spec.params)
        detokenizer = IncrementalDetokenizer(
            self.text.tokenizer, spec.prompt_ids, skip_special_tokens=spec.skip_special_tokens
        )
        matcher = StopStringMatcher(spec.stop)
        async for output in stream:
            self.completion_tokens += len(output.token_ids)
            self.cached_tokens = output.num_cached_tokens
            ids = output.token_ids
            if output.finish_reason == "stop" and ids and ids[-1] in self._hidden_ids:
                ids = ids[:-1]
            new_text = detokenizer.add(ids)
            if output.finish_reason is not None:
                new_text += detokenizer.flush()
            piece, matched = matcher.feed(new_text)
            if matched is not None:
                self.finish_reason = "stop"
                self.stop_string = matched
                stream.abort()
                if piece:
                    yield piece
                return
            if output.finish_reason is not None:
                piece += matcher.flush()
                self.finish_reason = output.finish_reason
                if piece:
                    yield piece
                return
            if piece:
                yield piece

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
