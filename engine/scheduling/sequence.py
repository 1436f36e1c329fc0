"""One request as the scheduler sees it: tokens, pages and progress.

token_ids may end with a placeholder (a negative number) for a token the
device has sampled but the host has not seen yet; see engine/scheduling/scheduler.py.
"""

from __future__ import annotations

import enum

from engine.kv.state_checkpoints import Place
from engine.sampling.draft_length import DraftLength
from engine.scheduling.media import SequenceMedia
from protocol import CacheHits, FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "block_hashes",
        "block_table",
        "cache_hits",
        "draft_length",
        "finish_reason",
        "last_checkpoint",
        "media",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_scored",
        "num_prompt_tokens",
        "params",
        "request_id",
        "reserved_pages",
        "state_restore",
        "status",
        "token_ids",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        # Hashes of this sequence's full pages, in order (a chain).
        self.block_hashes: list[bytes] = []
        # Tokens whose K/V are in the cache.
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at first admission.
        self.num_cached_tokens = 0
        # Where they came from, until the first output after admission sends it.
        self.cache_hits: CacheHits | None = None
        # Pages this sequence may grow into without preemption (see KVManager).
        self.reserved_pages = 0
        # Prompt positions whose next token's log probabilities a scheduled
        # step computes (SamplingParams.prompt_logprobs); never scored twice.
        self.num_prompt_scored = 0
        # How many tokens it drafts next, under speculative decoding (the
        # scheduler's, set at its first admission, from its recent
        # acceptance); None: it never drafts.
        self.draft_length: DraftLength | None = None
        self.finish_reason: FinishReason | None = None
        # Hybrid models (engine/kv/state_checkpoints.py): the checkpoint its
        # admission resumes from, until the scheduler queues the copy; and
        # the prefix length of its latest checkpoint (or resume point).
        self.state_restore: Place | None = None
        self.last_checkpoint = 0
        # A prompt with images (engine/scheduling/media.py); None: text only.
        self.media: SequenceMedia | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, pages={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def cache_ids(self) -> list[int]:
        """The token ids as the prefix cache hashes and compares them: the
        token ids themselves, but an image's tokens stand for its digest."""
        if self.media is None:
            return self.token_ids
        return self.media.key_ids + self.token_ids[self.num_prompt_tokens:]

    def rope_delta(self) -> int:
        """How far multimodal RoPE puts a token after the prompt from its index."""
        return 0 if self.media is None else self.media.delta

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def has_pending_token(self) -> bool:
        """The newest token is still on the device: a placeholder, -(slot + 1)
        (see Scheduler.add_pending_tokens)."""
        return bool(self.token_ids) and self.token_ids[-1] < 0

    @property
    def is_prefilling(self) -> bool:
        """True while more than the newest token still needs computing."""
        return self.num_uncomputed_tokens > 1
