"""A fixed pool of KV pages with reference counts and an LRU prefix cache.

Every page is in exactly one of three states:
- free: never filled or hash dropped; handed out first;
- cached: full, hashed, no sequence holds it; reusable by a prefix hit, and
  evicted in LRU order when free pages run out;
- in use: held by one or more sequences (ref count > 0).
check_invariants() verifies free + cached + in use == total.

A cached page evicted to make room is offered to on_evict first (the host
tier, engine/kv/host_tier.py), which queues a copy of its K/V that runs
before anything overwrites the page; with its parent's hash, which the disk
tier's admission needs (engine/kv/disk_tier.py). A finished sequence's pages
leave tail first (see release); the host tier puts them in chain order for
the disk (engine/kv/host_tier.py). on_forget hears of every page whose
hash is dropped (evicted or the cache cleared): the index of pages reusable
to the token (engine/kv/partial_pages.py) follows the pool through it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

# (page, its parent's hash, its hash, its tokens): a cached page about to be
# reused for others.
EvictHook = Callable[[int, bytes, bytes, tuple[int, ...]], None]
# A page whose hash was dropped.
ForgetHook = Callable[[int], None]


class PoolExhausted(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._ref_counts = [0] * num_pages
        self._hashes: list[bytes | None] = [None] * num_pages
        # The hash of the page before each one in its chain (ROOT_HASH first).
        self._parents: list[bytes | None] = [None] * num_pages
        self._tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        # Least recently used first.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self.on_evict: EvictHook | None = None
        self.on_forget: ForgetHook | None = None

    @property
    def num_free(self) -> int:
        """Pages that allocate() can hand out now (free plus evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def cached_pages(self) -> list[int]:
        """Ids of the cached pages, least recently used first (a copy: the
        engine keeps these pages' contents across a sleep)."""
        return list(self._cached)

    def cached_key(self, page: int) -> tuple[bytes, bytes, tuple[int, ...]]:
        """A cached page's parent hash, hash and tokens."""
        parent, page_hash, tokens = self._parents[page], self._hashes[page], self._tokens[page]
        assert parent is not None and page_hash is not None and tokens is not None, (
            f"page {page} is not cached")
        return parent, page_hash, tokens

    def is_registered(self, page: int) -> bool:
        """True for a page that holds a hash (cached or in use)."""
        return self._hashes[page] is not None

    def is_idle(self, page: int) -> bool:
        """True for a cached page that no sequence holds."""
        return self._ref_counts[page] == 0

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise PoolExhausted(f"asked for {count} KV pages, {self.num_free} available")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(page, *self.cached_key(page))
                self._forget(page)
            self._ref_counts[page] = 1
            pages.append(page)
        return pages

    def lookup(self, page_hash: bytes, tokens: Sequence[int]) -> int | None:
        """The page holding exactly these tokens after this hash chain, if cached."""
        page = self._by_hash.get(page_hash)
        if page is None or self._tokens[page] != tuple(tokens):
            return None
        return page

    def acquire(self, pages: Iterable[int]) -> None:
        """Take a reference on pages found by lookup()."""
        for page in pages:
            if self._ref_counts[page] == 0:
                del self._cached[page]
            self._ref_counts[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop a reference on each page; the caller passes a sequence's pages in
        reverse so its tail pages are evicted before its shared prefix."""
        for page in pages:
            count = self._ref_counts[page] - 1
            if count < 0:
                raise AssertionError(f"KV page {page} released more often than taken")
            self._ref_counts[page] = count
            if count == 0:
                if self._hashes[page] is not None:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def register(self, page: int, parent: bytes, page_hash: bytes, tokens: Sequence[int]
                 ) -> bool:
        """Record a page that just became full, after the chain parent, so
        later prompts can reuse it (or a partial page,
        engine/kv/partial_pages.py); False when it was not."""
        if self._hashes[page] is not None or page_hash in self._by_hash:
            # Already registered, or another sequence computed the same content
            # first: keep the first copy and let this one be freed plainly.
            return False
        self._hashes[page] = page_hash
        self._parents[page] = parent
        self._tokens[page] = tuple(tokens)
        self._by_hash[page_hash] = page
        return True

    def clear_cache(self) -> None:
        """Forget every cached page (no sequence holds any of them)."""
        while self._cached:
            page, _ = self._cached.popitem(last=False)
            self._forget(page)
            self._free.append(page)

    def drop_cached(self, page: int) -> None:
        """Forget one cached page nobody holds (a slot erase): it becomes free."""
        del self._cached[page]
        self._forget(page)
        self._free.append(page)

    def _forget(self, page: int) -> None:
        page_hash = self._hashes[page]
        if page_hash is not None:
            del self._by_hash[page_hash]
            if self.on_forget is not None:
                self.on_forget(page)
        self._hashes[page] = None
        self._parents[page] = None
        self._tokens[page] = None

    def check_invariants(self) -> None:
        in_use = sum(1 for count in self._ref_counts if count > 0)
        free = set(self._free)
        cached = set(self._cached)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & cached, "a page is both free and cached"
        assert len(free) + len(cached) + in_use == self.num_pages, (
            f"free {len(free)} + cached {len(cached)} + in use {in_use} != total {self.num_pages}"
        )
        for page in free | cached:
            assert self._ref_counts[page] == 0, f"page {page} is free/cached with references"
        for page in cached:
            assert self._hashes[page] is not None, f"cached page {page} has no hash"
        for page_hash, page in self._by_hash.items():
            assert self._hashes[page] == page_hash, f"hash index of page {page} is stale"
        for page in free:
            assert self._hashes[page] is None, f"free page {page} still has a hash"
