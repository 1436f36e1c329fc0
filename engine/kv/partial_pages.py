"""Reuse to the token: the leading tokens of a cached page, copied on write.

The prefix cache (engine/kv/block_pool.py) reuses whole pages by their chain
hash. Where the longest run of whole pages a prompt shares with the cache
ends, the prompt's next tokens may still match the start of a page that
continues the same chain: a conversation's last, partial page, or a full
page whose later tokens differ (a repeated 9-token prompt whose first page
filled up with generated tokens). This index finds such a page: every device
page that holds K/V of a known chain, keyed by the digest of the full pages
before it (the chain hash, ROOT_HASH for the first page) and its first token.

Which pages it holds:
- full pages, as the prefix cache registers them;
- the partial last page of a sequence that ends (finished, aborted or
  preempted), registered in the pool under partial_hash() so it is a cache
  entry like the others: held by no sequence, evicted least recently used
  (never offered to the host or disk tiers, which keep full pages only).
The pool tells this index when it drops a page's hash (on_forget).

A hit of k tokens never shares the page: the new sequence gets a fresh page
and a PageCopy of the first k token slots of every layer's K and V
(engine/execution/page_copy.py), run with the host tier's copies before the
next forward pass. The source page is pinned (a reference) while the step
is planned, so no later admission of the same step evicts it or has a host
load rewrite it before the copy reads it; nothing allocates between the end
of planning and the queueing of the copies. It is never written by the
sequence that copied it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from engine.kv.block_hash import hash_page

# Mixed into the hash of a partial page so it never equals a full page's.
_PARTIAL = b"partial page"


def partial_hash(parent: bytes, tokens: Sequence[int], fingerprint: bytes) -> bytes:
    """The pool key of a partial page holding tokens after the chain parent."""
    return hash_page(parent, tokens, fingerprint + _PARTIAL)


class PageCopy(NamedTuple):
    """K/V of token slots [0, num_tokens) of page source, copied into page target."""

    source: int
    target: int
    num_tokens: int


class PartialHit(NamedTuple):
    page: int
    num_tokens: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


class PartialPages:
    """Device pages by (chain digest before them, first token), with their tokens."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[bytes, int], dict[int, tuple[int, ...]]] = {}
        self._key_of: dict[int, tuple[bytes, int]] = {}
        # Admissions' copies until taken, and the source pages they pinned
        # until the step is planned.
        self._copies: list[PageCopy] = []
        self.pinned: list[int] = []
        # Admissions that took a partial hit, and the tokens they reused
        # (counted by KVManager where it counts the other tiers' hits).
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._key_of)

    def add(self, parent: bytes, page: int, tokens: Sequence[int]) -> None:
        """A page the pool just registered: it holds tokens after the chain parent."""
        if not tokens or page in self._key_of:
            return
        key = (parent, tokens[0])
        self._by_key.setdefault(key, {})[page] = tuple(tokens)
        self._key_of[page] = key

    def forget(self, page: int) -> None:
        """The pool dropped the page's hash (evicted, or the cache cleared)."""
        key = self._key_of.pop(page, None)
        if key is None:
            return
        pages = self._by_key[key]
        del pages[page]
        if not pages:
            del self._by_key[key]

    def best(self, parent: bytes, tokens: Sequence[int]) -> PartialHit | None:
        """The indexed page after parent whose tokens share the longest start
        with tokens (at least one), or None."""
        if not tokens:
            return None
        pages = self._by_key.get((parent, tokens[0]))
        if not pages:
            return None
        best: PartialHit | None = None
        for page, held in pages.items():
            count = common_prefix(held, tokens)
            if best is None or count > best.num_tokens:
                best = PartialHit(page, count)
                if count == len(tokens):
                    break
        return best

    def copy(self, hit: PartialHit, target: int) -> None:
        """Queue the copy of a hit into a fresh page (its source pinned by the caller)."""
        self._copies.append(PageCopy(hit.page, target, hit.num_tokens))
        self.pinned.append(hit.page)

    def take(self) -> list[PageCopy]:
        """The copies queued since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def take_pinned(self) -> list[int]:
        """The source pages pinned since the last call (for the caller to release)."""
        pinned, self.pinned = self.pinned, []
        return pinned

    def check_invariants(self, is_registered: Callable[[int], bool]) -> None:
        """Every indexed page is one the pool holds a hash for."""
        stale = [page for page in self._key_of if not is_registered(page)]
        assert not stale, f"partial index holds pages the pool forgot: {stale}"
        assert sum(len(pages) for pages in self._by_key.values()) == len(self._key_of), (
            "partial index is stale")
