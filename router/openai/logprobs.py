"""Log probabilities in the OpenAI shapes.

The engine sends, per token, its log probability and those of the most likely
tokens at its position (protocol TokenLogprobs), from the model's raw
distribution: before logit bias, penalties, grammar masks and temperature.
These turn them into

- Chat Completions' `logprobs.content` entries: {token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]};
- Completions' parallel lists: tokens, token_logprobs, top_logprobs (a dict
  of the N most likely tokens plus the chosen one, so up to N + 1 entries;
  null for an unscored token, the first of an echoed prompt) and text_offset.

A token's text is its bytes read as UTF-8, a part of a character as U+FFFD
(the exact bytes go in `bytes`). text_offset is the character of the
returned text where a token starts: the characters its predecessors' bytes
complete, counted from the start of the text (the generated tokens from the
end of the echoed prompt); a token that goes on with a character its
predecessor began starts where that character does.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from protocol import TokenLogprobs
from router.text.token_pieces import TokenPieces

# OpenAI's value for a token the model rules out: JSON has no -Infinity.
FLOOR = -9999.0


def json_logprob(value: float) -> float:
    """value, or FLOOR for -inf (and NaN), which JSON cannot carry."""
    return value if value >= FLOOR else FLOOR


class TokenTexts:
    """Each token's text and bytes, worked out once per request."""

    def __init__(self, pieces: TokenPieces):
        self._pieces = pieces
        self._known: dict[int, tuple[str, bytes]] = {}

    def of(self, token_id: int) -> tuple[str, bytes]:
        known = self._known.get(token_id)
        if known is None:
            data = self._pieces.token_bytes(token_id)
            known = self._known[token_id] = (data.decode(errors="replace"), data)
        return known

    def text(self, token_id: int) -> str:
        return self.of(token_id)[0]


class ChatLogprobs:
    """Chat Completions' `logprobs.content` entries."""

    def __init__(self, texts: TokenTexts):
        self._texts = texts

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, data = self._texts.of(token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(data)}

    def entries(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        """One entry per scored token (token_ids may run one past: a hidden stop token)."""
        out = []
        for token_id, scored in zip(token_ids, logprobs, strict=False):
            entry = self._token(token_id, scored.logprob)
            entry["top_logprobs"] = [self._token(top_id, value) for top_id, value
                                     in zip(scored.top_ids, scored.top_logprobs, strict=True)]
            out.append(entry)
        return out

    @staticmethod
    def body(entries: list[dict[str, Any]]) -> dict[str, Any]:
        return {"content": entries, "refusal": None}


class CompletionLogprobs:
    """Completions' logprobs object of one choice, made part by part as its
    tokens come; text_offset runs on from part to part."""

    def __init__(self, texts: TokenTexts):
        self._texts = texts
        self.offset = 0
        # The bytes of a character the tokens so far began and not yet ended.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def restart_at(self, offset: int) -> None:
        """Count on from offset, a character boundary (the echoed prompt's end)."""
        self.offset = offset
        self._decoder.reset()

    def part(self, token_ids: Sequence[int],
             logprobs: Sequence[TokenLogprobs | None]) -> dict[str, list[Any]]:
        """The four lists for these tokens; a None entry is an unscored token
        (null logprob and alternatives)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, scored in zip(token_ids, logprobs, strict=False):
            text, data = self._texts.of(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(self._decoder.decode(data))
            if scored is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            value = json_logprob(scored.logprob)
            token_logprobs.append(value)
            # The chosen token first, then the most likely ones (a text two
            # tokens share keeps the first value).
            top = {text: value}
            for top_id, top_value in zip(scored.top_ids, scored.top_logprobs, strict=True):
                top.setdefault(self._texts.text(top_id), json_logprob(top_value))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def prompt_part(self, prompt_ids: Sequence[int],
                    prompt_logprobs: Sequence[TokenLogprobs]) -> dict[str, list[Any]]:
        """An echoed prompt's tokens: the first unscored, the rest scored."""
        return self.part(prompt_ids, [None, *prompt_logprobs])


def joined(parts: Sequence[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """Parts of one choice's Completions logprobs as one object."""
    whole: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
    for part in parts:
        for key, values in part.items():
            whole[key].extend(values)
    return whole
