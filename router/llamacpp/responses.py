"""The bodies /completion answers with, field for field as llama.cpp's server
writes them (server_task_result_cmpl_partial/final::to_json_non_oaicompat):

- the answer, or a stream's last chunk: `stop: true`, the counts,
  `generation_settings`, `prompt`, `stop_type`, `stopping_word`, `timings`;
  `response_fields` keeps only the fields it names;
- a streamed token: `content`, `tokens`, `stop: false`, the counts, and
  `timings` with `timings_per_token`;
- a prompt progress chunk (`return_progress`): no text, `prompt_progress`.

With n_probs > 0 a streamed token's chunk carries `completion_probabilities`
for its tokens, and the whole answer (not a stream's last chunk) for all
of them (router/llamacpp/probabilities.py); the end-of-sequence token that
ended the answer has its entry too, as in llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol import TokenLogprobs
from router.generation import Generation, Piece, PromptProgress
from router.llamacpp.probabilities import ProbabilityWriter, drop_stop_word


def select_fields(body: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama.cpp's response_fields: each path ("generation_settings/n_predict")
    that exists becomes a top-level field named by the whole path; missing
    ones are left out without an error."""
    selected: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            selected[path] = value
    return selected


def stop_type(generation: Generation) -> str:
    """eos, word, limit or none (llama.cpp's stop_type)."""
    if generation.finish_reason == "length":
        return "limit"
    if generation.finish_reason == "stop":
        return "word" if generation.stop_string is not None else "eos"
    return "none"


@dataclass
class CompletionReport:
    """What every chunk of one /completion answer repeats, and how to write them."""

    generation: Generation
    model: str
    id_slot: int
    settings: dict[str, Any]
    prompt: str
    stream: bool
    return_tokens: bool
    timings_per_token: bool
    response_fields: Sequence[str]
    # n_predict 0: the prompt was evaluated; the one token computed is not shown.
    prompt_only: bool = False
    # n_probs > 0: writes completion_probabilities.
    probabilities: ProbabilityWriter | None = None

    def _counts(self) -> dict[str, Any]:
        return {
            "id_slot": self.id_slot,
            "tokens_predicted": 0 if self.prompt_only else self.generation.completion_tokens,
            "tokens_evaluated": self.generation.prompt_tokens,
        }

    def _timings(self) -> dict[str, Any]:
        timings = self.generation.timings()
        if self.prompt_only:
            timings.update(predicted_n=0, predicted_ms=0.0, predicted_per_token_ms=0.0,
                           predicted_per_second=0.0)
        return timings

    def partial(self, piece: Piece) -> dict[str, Any]:
        body: dict[str, Any] = {"index": 0, "content": piece.text, "tokens": piece.token_ids,
                                "stop": False, **self._counts()}
        if self.timings_per_token:
            body["timings"] = self._timings()
        if self.probabilities is not None:
            entries = self.probabilities.entries(self._scored(piece.token_ids, piece.logprobs))
            if entries:
                body["completion_probabilities"] = entries
        return body

    def _scored(self, token_ids: Sequence[int],
                logprobs: Sequence[TokenLogprobs]) -> list[tuple[int, TokenLogprobs]]:
        """Tokens with their log probabilities, the hidden stop token's included."""
        scored = list(zip(token_ids, logprobs, strict=False))
        stop = self.generation.stop_token_logprobs
        if stop is not None and len(token_ids) == len(logprobs) + 1 \
                and token_ids[-1] == self.generation.stop_token:
            scored.append((token_ids[-1], stop))
        return scored

    def _all_probabilities(self, writer: ProbabilityWriter) -> list[dict[str, Any]]:
        generation = self.generation
        entries = writer.entries(self._scored(generation.token_ids, generation.logprobs))
        if generation.stop_string is not None:
            entries = drop_stop_word(entries, writer.count_tokens(generation.stop_string))
        return entries

    def progress(self, progress: PromptProgress, elapsed_ms: int) -> dict[str, Any]:
        return {
            "index": 0, "content": "", "tokens": [], "stop": False, **self._counts(),
            "prompt_progress": {"total": progress.total, "cache": progress.cached,
                                "processed": progress.processed, "time_ms": elapsed_ms},
        }

    def final(self, content: str, has_new_line: bool) -> dict[str, Any]:
        """The whole answer, or (streamed) the last chunk, whose text and
        tokens went out already."""
        generation = self.generation
        tokens = generation.token_ids if self.return_tokens and not self.prompt_only else []
        body: dict[str, Any] = {
            "index": 0,
            "content": "" if self.stream else content,
            "tokens": [] if self.stream else tokens,
            "id_slot": self.id_slot,
            "stop": True,
            "model": self.model,
            "tokens_predicted": self._counts()["tokens_predicted"],
            "tokens_evaluated": generation.prompt_tokens,
            "generation_settings": self.settings,
            "prompt": self.prompt,
            "has_new_line": has_new_line,
            # The context never overflows into a shift here: generation stops at its end.
            "truncated": False,
            "stop_type": "limit" if self.prompt_only else stop_type(generation),
            "stopping_word": generation.stop_string or "",
            "tokens_cached": generation.cached_tokens,
            "timings": self._timings(),
        }
        if self.probabilities is not None and not self.stream and not self.prompt_only:
            entries = self._all_probabilities(self.probabilities)
            if entries:
                body["completion_probabilities"] = entries
        return select_fields(body, self.response_fields) if self.response_fields else body
