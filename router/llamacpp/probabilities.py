"""/completion's `completion_probabilities` (n_probs > 0), entry for entry as
llama.cpp's server writes them (completion_token_output::probs_vector_to_json):

    {"id", "token", "bytes", "logprob", "top_logprobs": [{"id", "token", "bytes", "logprob"}]}

from the model's raw distribution, or with post_sampling_probs

    {"id", "token", "bytes", "prob", "top_probs": [{"id", "token", "bytes", "prob"}]}

from the distribution the token was drawn from (the engine's "processed"
log probabilities): tokens the sampler cut have probability 0 and are not
listed, so top_probs may hold fewer than n_probs entries (one for a greedy
token, whose prob is 1).

A token's text is its piece as llama.cpp prints it without `special`: a
control token (end of sequence, <|im_start|>) is "", and a piece that ends
inside a UTF-8 character loses that partial character (`bytes` keeps all).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from protocol import TokenLogprobs
from router.text.token_pieces import TokenPieces, pieces_for
from router.text.tokenizer import Tokenizer

# What llama.cpp writes for log(0): the lowest float, as JSON has no -inf.
LOG_ZERO = -3.4028234663852886e38


def _valid_prefix(data: bytes) -> int:
    """The length of data without a UTF-8 character cut off at its end
    (llama.cpp's validate_utf8)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the last lead byte (or ASCII)
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else \
                4 if byte & 0xF8 == 0xF0 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


class TokenTexts:
    """One tokenizer's tokens as llama.cpp's probabilities show them."""

    def __init__(self, tokenizer: Tokenizer):
        self._pieces: TokenPieces = pieces_for(tokenizer)
        decoder = tokenizer.backend.get_added_tokens_decoder()
        self._control = frozenset(i for i, token in decoder.items() if token.special)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def of(self, token_id: int) -> tuple[str, list[int]]:
        """(token, bytes) of one token id."""
        known = self._cache.get(token_id)
        if known is None:
            data = b"" if token_id in self._control else self._pieces.token_bytes(token_id)
            known = (data[:_valid_prefix(data)].decode(errors="replace"), list(data))
            self._cache[token_id] = known
        return known


_TEXTS: weakref.WeakKeyDictionary[Tokenizer, TokenTexts] = weakref.WeakKeyDictionary()


def token_texts(tokenizer: Tokenizer) -> TokenTexts:
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        texts = _TEXTS[tokenizer] = TokenTexts(tokenizer)
    return texts


class ProbabilityWriter:
    """Turns generated tokens and their log probabilities into entries."""

    def __init__(self, tokenizer: Tokenizer, post_sampling: bool):
        self._tokenizer = tokenizer
        self._texts = token_texts(tokenizer)
        self.post_sampling = post_sampling

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer.encode(text))

    def entries(self, tokens: Iterable[tuple[int, TokenLogprobs]]) -> list[dict[str, Any]]:
        return [self._entry(token_id, logprobs) for token_id, logprobs in tokens]

    def _entry(self, token_id: int, logprobs: TokenLogprobs) -> dict[str, Any]:
        entry = self._one(token_id, logprobs.logprob)
        alternatives = zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)
        if self.post_sampling:
            # The cut tokens (probability 0) are not candidates any more.
            entry["top_probs"] = [self._one(i, v) for i, v in alternatives if math.exp(v) > 0.0]
        else:
            entry["top_logprobs"] = [self._one(i, v) for i, v in alternatives]
        return entry

    def _one(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, data = self._texts.of(token_id)
        entry: dict[str, Any] = {"id": token_id, "token": text, "bytes": data}
        if self.post_sampling:
            entry["prob"] = math.exp(logprob)
        else:
            entry["logprob"] = logprob if math.isfinite(logprob) else LOG_ZERO
        return entry


def drop_stop_word(entries: Sequence[dict[str, Any]], stop_word_tokens: int) -> list[dict[str, Any]]:
    """A whole answer ended by a stop string leaves out as many entries at
    its end as the stop string has tokens, as llama.cpp does."""
    return list(entries[:len(entries) - min(len(entries), stop_word_tokens)])
