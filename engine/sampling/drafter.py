"""Drafters: cheap guesses of a sequence's next few tokens, which one target
step then verifies (engine/sampling/verify.py) instead of decoding them one
at a time.

A drafter sees only token ids the host knows (the prompt and the output so
far, no placeholder) and proposes up to a given number of tokens; an empty
proposal means "decode this row as usual". A draft model
(engine/sampling/draft_model.py) keeps state per sequence and drafts a step's
rows together (BatchDrafter); so does a checkpoint's MTP head
(engine/sampling/mtp_drafter.py), from the target's hidden states.

Rows whose next token is drawn from the model's logits as they come (greedy,
or sampled with temperature, top-k, top-p and min-p) may draft (may_draft);
engine/sampling/verify.py keeps their tokens distributed exactly as without
drafts. Grammar rows (structured output, forced tool calls) and rows with a
reasoning budget draft too: the engine cuts a draft before the first token
the grammar refuses or would end on, and before the first position whose
token the budget forces (Scheduler.cut_draft), and masks each draft position
with the grammar's mask after the draft tokens before it
(engine/sampling/grammar.py), so their tokens are exactly those without
drafts. Rows with a logit bias, penalties or log probabilities (top
alternatives, named token ids, "processed" mode) draft too: each draft
position gets the bias, and penalties whose counts include the draft tokens
before it (engine/sampling/penalty_state.py, apply_ahead), and reports the
log probabilities plain decoding would there
(engine/sampling/draft_logprobs.py). Rows that score their prompt and
embeddings do not draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class DraftRow:
    """One row's ask of a drafter that drafts a step's rows together."""

    key: str  # the request id, which keys what the drafter keeps per sequence
    token_ids: Sequence[int]
    max_tokens: int
    # The sequence's lane and page table (an MTP head keeps its state by
    # lane and writes K/V in the target's pages: engine/sampling/mtp_drafter.py).
    lane: int = -1
    pages: Sequence[int] = ()


class BatchDrafter(Drafter, Protocol):
    """A drafter with per-sequence state (a draft model's KV cache) that
    drafts all of a step's rows at once (engine/sampling/draft_model.py)."""

    def propose_batch(self, rows: list[DraftRow]) -> list[list[int]]:
        """Per row, up to row.max_tokens guesses after row.token_ids."""
        ...

    def forget(self, key: str) -> None:
        """The sequence ended: drop what was kept for it."""
        ...

    def sleep(self) -> None:
        """The engine sleeps (no requests): release device memory."""
        ...

    def wake(self) -> None:
        ...


def may_draft(params: SamplingParams) -> bool:
    """Whether a request's rows may draft: everything that shapes or reads
    its logits (a grammar's mask, a forced token, logit bias, penalties, log
    probabilities) is handled per draft position; a scored prompt or an
    embedding is not."""
    return params.prompt_logprobs < 0 and params.pooling is None and params.max_tokens > 0


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
