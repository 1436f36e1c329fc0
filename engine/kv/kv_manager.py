"""Which pages each sequence holds, prefix reuse, and admission reservations.

Admission reserves pages for a sequence's tokens plus a bounded output window
(EngineOptions.output_window); `outstanding` counts reserved pages not yet
allocated, and new admissions only take what is left after them, so a running
sequence can always grow within its window. Growing past the window takes
unreserved free pages; when there are none the scheduler preempts.
"""

from __future__ import annotations

from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.block_pool import BlockPool
from engine.scheduling.sequence import Sequence


class KVManager:
    def __init__(self, pool: BlockPool, fingerprint: bytes, output_window: int, max_context: int):
        self.pool = pool
        self.page_size = pool.page_size
        self.fingerprint = fingerprint
        self.output_window = output_window
        self.max_context = max_context
        self.outstanding = 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full pages at the start of seq's tokens.

        Only pages wholly inside the first num_tokens - 1 tokens count: the
        last token is always computed, since its logits are needed.
        """
        pages: list[int] = []
        hashes: list[bytes] = []
        params = seq.params
        if params.prompt_logprobs >= 0 or params.pooling in ("mean", "cls"):
            # Scoring needs every prompt position's logits, mean pooling every
            # position's hidden state, CLS the first's: nothing is skipped.
            # (Last pooling reads only the last token, which is always computed.)
            return pages, hashes
        parent = ROOT_HASH
        ps = self.page_size
        for index in range((seq.num_tokens - 1) // ps):
            tokens = seq.token_ids[index * ps : (index + 1) * ps]
            page_hash = hash_page(parent, tokens, self.fingerprint)
            page = self.pool.lookup(page_hash, tokens)
            if page is None:
                break
            pages.append(page)
            hashes.append(page_hash)
            parent = page_hash
        return pages, hashes

    def try_admit(self, seq: Sequence) -> bool:
        """Give seq pages for all its tokens and reserve its output window."""
        cached, hashes = self._cached_prefix(seq)
        remaining_output = max(seq.params.max_tokens - seq.num_output_tokens, 0)
        target_tokens = min(
            seq.num_tokens + min(self.output_window, remaining_output), self.max_context
        )
        target_pages = max(self.pages_for(target_tokens), self.pages_for(seq.num_tokens))
        # Cached pages nobody holds are counted in pool.num_free; taking them
        # does not use up a free page for the new ones.
        idle_hits = sum(1 for page in cached if self.pool.is_idle(page))
        available = self.pool.num_free - idle_hits - self.outstanding
        if target_pages - len(cached) > available:
            return False
        self.pool.acquire(cached)
        fresh = self.pool.allocate(self.pages_for(seq.num_tokens) - len(cached))
        seq.block_table = cached + fresh
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(cached) * self.page_size
        seq.reserved_pages = target_pages
        self.outstanding += target_pages - len(seq.block_table)
        return True

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's pages cover num_tokens tokens; False when the pool can't."""
        needed = self.pages_for(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        reserved = min(needed, max(seq.reserved_pages - len(seq.block_table), 0))
        unreserved = needed - reserved
        if unreserved > self.pool.num_free - self.outstanding:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        self.outstanding -= reserved
        return True

    def commit(self, seq: Sequence) -> None:
        """Register pages that the last step filled, for later prefix hits."""
        ps = self.page_size
        full_pages = seq.num_computed_tokens // ps
        while len(seq.block_hashes) < full_pages:
            index = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if index else ROOT_HASH
            tokens = seq.token_ids[index * ps : (index + 1) * ps]
            page_hash = hash_page(parent, tokens, self.fingerprint)
            self.pool.register(seq.block_table[index], page_hash, tokens)
            seq.block_hashes.append(page_hash)

    def free(self, seq: Sequence) -> None:
        self.outstanding -= max(seq.reserved_pages - len(seq.block_table), 0)
        # Tail first: the prefix, shared more often, stays cached longer.
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        seq.block_hashes = []
        seq.reserved_pages = 0
        seq.num_computed_tokens = 0

    def check_invariants(self, running: list[Sequence]) -> None:
        self.pool.check_invariants()
        expected = sum(max(s.reserved_pages - len(s.block_table), 0) for s in running)
        assert self.outstanding == expected, (
            f"outstanding reservations {self.outstanding} != {expected} summed over running"
        )
        assert self.outstanding <= self.pool.num_free, (
            f"reserved {self.outstanding} pages but only {self.pool.num_free} are free"
        )
