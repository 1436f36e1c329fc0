"""Drafters: cheap guesses of a sequence's next few tokens, which one target
step then verifies (engine/sampling/verify.py) instead of decoding them one
at a time.

A drafter sees only token ids the host knows (the prompt and the output so
far, no placeholder) and proposes up to a given number of tokens; an empty
proposal means "decode this row as usual". Drafters that come later (a draft
model, MTP or EAGLE heads) answer the same call.

Rows whose next token is drawn from the model's logits as they come (greedy,
or sampled with temperature, top-k, top-p and min-p) may draft (may_draft);
engine/sampling/verify.py keeps their tokens distributed exactly as without
drafts. Rows with something that changes the logits or needs them per
position (grammar, penalties, logit bias, log probabilities, a reasoning
budget's forced tokens, prompt scoring, pooling) do not yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from protocol import SamplingParams

# llama.cpp's lookup decoding and vLLM's prompt lookup both default to small
# n-grams; 1..3 finds a match often and the longest one is tried first.
DEFAULT_NGRAM_MIN = 1
DEFAULT_NGRAM_MAX = 3
DEFAULT_DRAFT_TOKENS = 4


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to max_tokens guesses of the tokens after token_ids (all known)."""
        ...


def may_draft(params: SamplingParams) -> bool:
    """Whether a request's rows may draft: its next token is the argmax of,
    or a draw from, the raw logits (temperature and truncation only), and
    nothing is asked of them per position."""
    return (params.grammar is None and params.reasoning is None
            and not params.logit_bias and params.logprobs < 0 and params.prompt_logprobs < 0
            and params.pooling is None and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
            and params.max_tokens > 0)


class NgramDrafter:
    """Prompt lookup: find the sequence's last n tokens earlier in its own
    prompt and output (n from max_n down to min_n, the most recent match of
    the longest n that has one) and propose what followed them there."""

    def __init__(self, min_n: int = DEFAULT_NGRAM_MIN, max_n: int = DEFAULT_NGRAM_MAX) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        length = len(token_ids)
        if max_tokens < 1 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0..length-1-n: each has a token after it,
            # and none is the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + max_tokens].tolist()
        return []
