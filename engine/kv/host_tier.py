"""The context cache below the device: tiers of full KV pages keyed by their
prefix digest (engine/kv/block_hash.py), and the host RAM tier.

A tier holds copies of full pages. The device prefix cache (BlockPool) offers
it each page it evicts; admission looks up the pages that follow the device
hits, and each one found is copied back into a fresh device page. A page's
hash covers every token before it and the model's KV format, so a tier never
needs to know which request a page came from; tokens are compared on a hit
as the device cache does.

This module is pure bookkeeping (no torch): which slot of the host pool holds
which page. The bytes move in engine/execution/host_kv.py, driven by the
KVTransfers this module queues, before the next forward pass.

The disk tier (engine/kv/disk_tier.py) sits behind the host tier:
HostTier.store evicts its least recently used page to make room and offers it
to on_evict first, while its bytes are still in the slot (the queued copy
into it has not run). A page whose own copy into the slot is still queued has
no bytes there yet: it is not offered, and that copy is cancelled.

The disk writes a page only after its parent (DiskTier.spill), but the device
evicts a finished request's pages tail first (it keeps shared prefixes
longest), so they reach this tier children first, and plain LRU would offer
the disk every chain backwards: orphans all, but the head. So when the least
recently used page's parent is here too, and the disk has room, the tier
evicts instead its first ancestor here that the disk would take (one whose
parent is ROOT_HASH or on disk): chains leave head first, each page after its
parent. When the disk takes nothing (its queue full, or the chain's head
still on the device), the least recently used page goes, as before, and this
tier keeps the rest of its chain whole.

Disk restores (engine/kv/disk_restore.py) take slots in two more ways: a
slot reserved for a page being read from disk belongs to no page (nothing
finds, evicts or copies it) until fill() registers the page read into it or
unreserve() frees it; and a page held (hold(), by hash, counted) for a
request waiting on its restore is never evicted until released.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Protocol

from engine.kv.partial_pages import PageCopy
from protocol import EngineStats

# (slot, its page's parent hash, its hash, its tokens): a page about to leave
# the host tier.
HostEvictHook = Callable[[int, bytes, bytes, tuple[int, ...]], None]


class HostPage(NamedTuple):
    """The page a slot holds: its chain parent's hash, its hash, its tokens."""

    parent: bytes
    page_hash: bytes
    tokens: tuple[int, ...]


class ChainStore(Protocol):
    """The tier below, as far as the order of evictions goes (DiskTier)."""

    def has_room(self) -> bool:
        """It would queue a page now."""
        ...

    def continues(self, parent: bytes) -> bool:
        """A page after parent would be admitted: parent is ROOT_HASH or held."""
        ...


class KVTier(Protocol):
    """A store of full KV pages below the device, keyed by page hash.

    find() only looks; take() commits to reading a page found (the slot stays
    put until the queued copies run); store() takes a page the tier above
    evicts, or returns None when it keeps it already or cannot take it."""

    def find(self, page_hash: bytes, tokens: Sequence[int]) -> int | None: ...

    def take(self, slot: int) -> None: ...

    def store(self, parent: bytes, page_hash: bytes, tokens: Sequence[int]) -> int | None: ...


def copy_counters(counters: Any, stats: EngineStats, prefix: str) -> None:
    """Each field of a tier's counters dataclass into the EngineStats field
    named {prefix}_{field}_total (every counter has one: a new counter with
    no field in EngineStats fails here, in the tests, rather than going unseen)."""
    for item in fields(counters):
        name = f"{prefix}_{item.name}_total"
        if not hasattr(stats, name):
            raise AttributeError(f"EngineStats has no {name} for the counter {item.name}")
        setattr(stats, name, getattr(counters, item.name))


@dataclass
class TierCounters:
    """What a tier did since the engine started (EngineStats host_kv_*)."""

    # Pages (and their tokens) admissions took from this tier, counted by
    # KVManager once per admission, as its num_cached_tokens is.
    hit_pages: int = 0
    hit_tokens: int = 0
    # Admissions whose lookup in this tier stopped at a page it does not hold.
    misses: int = 0
    stored_pages: int = 0
    evicted_pages: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0


@dataclass
class KVTransfers:
    """Copies between device pages and host slots, queued while a step is
    scheduled and run before its forward pass: every store first (they read
    device pages that the step may overwrite), then every load. A slot being
    loaded is never reused by a store in the same batch (HostTier pins it).
    Last, the copies of pages reused to the token (engine/kv/partial_pages.py),
    device to device: a page they read may be one a load just filled."""

    # (device page, host slot): an evicted page's K/V, copied to the host.
    stores: list[tuple[int, int]] = field(default_factory=list)
    # (host slot, device page): a page found in the host tier, copied back.
    loads: list[tuple[int, int]] = field(default_factory=list)
    # The leading token slots of a cached page, copied into a fresh page.
    copies: list[PageCopy] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.copies)


class HostTier:
    """Slots of a host memory pool holding full KV pages, least recently used
    out. A page hash is stored once: a page evicted from the device again while
    the tier holds it only refreshes its place in the LRU order."""

    def __init__(self, num_slots: int, page_size: int, page_bytes: int):
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.counters = TierCounters()
        self.transfers = KVTransfers()
        self._free = list(range(num_slots - 1, -1, -1))
        # Least recently used first.
        self._slots: OrderedDict[int, HostPage] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        # Slots read by queued loads: not reused until the transfers are taken.
        self._pinned: set[int] = set()
        # Slots whose copy from the device is queued: no bytes there yet.
        self._storing: set[int] = set()
        # Slots a disk read fills (off the engine's loop): no page's yet.
        self._reserved: set[int] = set()
        # Pages a request waiting on its disk restore will load: kept.
        self._held: Counter[bytes] = Counter()
        self.on_evict: HostEvictHook | None = None
        # Where evicted pages go, consulted for the order they leave in.
        self.below: ChainStore | None = None
        # The last least recently used page and its ancestors here, towards
        # the chain's head, as hashes: evicting a long chain head first walks
        # it once, not once per page (see _parent_first).
        self._ascent: deque[bytes] = deque()

    @property
    def num_cached(self) -> int:
        return len(self._slots)

    def find(self, page_hash: bytes, tokens: Sequence[int]) -> int | None:
        slot = self._by_hash.get(page_hash)
        if slot is None or self._slots[slot].tokens != tuple(tokens):
            return None
        return slot

    def take(self, slot: int) -> None:
        self._slots.move_to_end(slot)
        self._pinned.add(slot)

    def load(self, slot: int, page: int) -> None:
        """Queue the copy of a slot found by find() (or one the disk tier
        read into) into a device page. Whose hit it is, KVManager counts."""
        self.take(slot)
        self.transfers.loads.append((slot, page))
        self.counters.bytes_to_device += self.page_bytes

    def store(self, parent: bytes, page_hash: bytes, tokens: Sequence[int]) -> int | None:
        known = self._by_hash.get(page_hash)
        if known is not None:
            self._slots.move_to_end(known)
            return None
        slot = self._vacate()
        if slot is None:
            return None  # every slot is being read this step (or held): the page is dropped
        self._slots[slot] = HostPage(parent, page_hash, tuple(tokens))
        self._by_hash[page_hash] = slot
        return slot

    def _vacate(self) -> int | None:
        """A free slot, or one whose page is evicted (offered to on_evict):
        the least recently used page neither pinned nor held, or an
        ancestor of it (_parent_first); None when none can be."""
        if self._free:
            return self._free.pop()
        slot = next((s for s, page in self._slots.items() if self._evictable(s, page)), None)
        if slot is None:
            return None
        slot = self._parent_first(slot)
        victim = self._slots.pop(slot)
        del self._by_hash[victim.page_hash]
        self.counters.evicted_pages += 1
        stores = self.transfers.stores
        if slot in self._storing:
            self._storing.discard(slot)
            self.transfers.stores = [(p, s) for p, s in stores if s != slot]
        elif self.on_evict is not None:
            self.on_evict(slot, *victim)
        return slot

    def _evictable(self, slot: int, page: HostPage) -> bool:
        return slot not in self._pinned and page.page_hash not in self._held

    def _parent_first(self, victim: int) -> int:
        """The slot to evict in place of victim, the least recently used
        page: the first of its ancestors here (victim included) that the
        tier below would take, if the chain up to one is evictable here;
        else victim. Walks are remembered in _ascent: the next eviction
        (the same victim, or the page before it) goes on from there."""
        below = self.below
        if below is None or not below.has_room():
            return victim
        path = self._ascent
        victim_hash = self._slots[victim].page_hash
        # The previous walk's victims since evicted, and its heads since gone.
        while path and path[0] != victim_hash and path[0] not in self._by_hash:
            path.popleft()
        if not path or path[0] != victim_hash:
            path.clear()
            path.append(victim_hash)
        while len(path) > 1 and not self._offerable(path[-1]):
            path.pop()
        while True:
            slot = self._by_hash[path[-1]]
            parent = self._slots[slot].parent
            if below.continues(parent):
                return slot
            if not self._offerable(parent):
                return victim  # the chain's head is elsewhere, or kept here
            path.append(parent)

    def _offerable(self, page_hash: bytes) -> bool:
        """The page is here, evictable, and its bytes are in its slot."""
        slot = self._by_hash.get(page_hash)
        return (slot is not None and slot not in self._storing
                and self._evictable(slot, self._slots[slot]))

    # ---- slots filled from the disk, off the engine's loop --------------------

    def reserve(self) -> int | None:
        """A slot for a page read from disk (on another thread): it belongs
        to no page until fill() or unreserve(). None: none can be had."""
        slot = self._vacate()
        if slot is not None:
            self._reserved.add(slot)
        return slot

    def fill(self, slot: int, parent: bytes, page_hash: bytes, tokens: Sequence[int]) -> int:
        """The page is read into reserved slot: register it; returns the slot
        that holds the page (another one when the device evicted the same
        page to this tier meanwhile: the reserved slot is then freed)."""
        self._reserved.remove(slot)
        known = self._by_hash.get(page_hash)
        if known is not None:
            self._free.append(slot)
            self._slots.move_to_end(known)
            return known
        self._slots[slot] = HostPage(parent, page_hash, tuple(tokens))
        self._by_hash[page_hash] = slot
        return slot

    def unreserve(self, slot: int) -> None:
        """The read into reserved slot failed or was dropped: free it."""
        self._reserved.remove(slot)
        self._free.append(slot)

    def hold(self, page_hash: bytes) -> None:
        """Keep the page (if held here) from eviction until release()."""
        self._held[page_hash] += 1
        slot = self._by_hash.get(page_hash)
        if slot is not None:
            self._slots.move_to_end(slot)

    def release(self, page_hash: bytes) -> None:
        self._held[page_hash] -= 1
        if not self._held[page_hash]:
            del self._held[page_hash]

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def offload(self, page: int, parent: bytes, page_hash: bytes, tokens: Sequence[int]
                ) -> None:
        """A device page evicted from the prefix cache: keep a copy, queued
        before anything overwrites the page. A partial page (fewer tokens
        than a page: engine/kv/partial_pages.py) is not kept: the tiers hold
        full pages only."""
        if len(tokens) != self.page_size:
            return
        slot = self.store(parent, page_hash, tokens)
        if slot is None:
            return
        self.transfers.stores.append((page, slot))
        self._storing.add(slot)
        self.counters.stored_pages += 1
        self.counters.bytes_to_host += self.page_bytes

    def discard(self, slot: int) -> None:
        """Drop a slot's page and free the slot (a /slots erase)."""
        del self._by_hash[self._slots.pop(slot).page_hash]
        self._pinned.discard(slot)
        self._ascent.clear()  # it may have been on the way to a chain's head
        self._free.append(slot)

    def resident(self) -> list[tuple[int, bytes, bytes, tuple[int, ...]]]:
        """(slot, parent hash, hash, tokens) of every page whose bytes are in
        its slot (or on their way: copies queued before), least recently
        used first."""
        queued = {slot for _, slot in self.transfers.stores}
        return [(slot, *page) for slot, page in self._slots.items() if slot not in queued]

    def take_transfers(self) -> KVTransfers:
        """The copies queued since the last call; their slots may be reused
        after this (the copies are ordered before any later one)."""
        transfers, self.transfers = self.transfers, KVTransfers()
        self._pinned.clear()
        self._storing.clear()
        return transfers

    def report(self, stats: EngineStats) -> None:
        """Copy the tier's size and counters into the engine's stats."""
        stats.host_kv_pages_total = self.num_slots
        stats.host_kv_pages_cached = len(self._slots)
        copy_counters(self.counters, stats, "host_kv")

    def cached_hashes(self) -> list[bytes]:
        """Hashes held, least recently used first."""
        return [page.page_hash for page in self._slots.values()]

    def check_invariants(self) -> None:
        free, cached, reserved = len(self._free), len(self._slots), len(self._reserved)
        assert free + cached + reserved == self.num_slots, (
            f"host tier: free {free} + cached {cached} + reserved {reserved} != {self.num_slots}")
        assert not set(self._free) & self._slots.keys(), "a host slot is both free and cached"
        assert not self._reserved & (set(self._free) | self._slots.keys()), (
            "a reserved host slot is also free or cached")
        assert len(self._by_hash) == len(self._slots), "host tier hash index is stale"
        for page_hash, slot in self._by_hash.items():
            assert self._slots[slot].page_hash == page_hash, f"host slot {slot}'s hash index is stale"
