"""The disk tier's index (engine/kv/disk_tier.py): which pages it holds, in
least recently used order, and which page each continues, so that its byte
budget evicts chains from their ends.

A lookup walks a prompt page by page from its first, so a page whose parent
is gone is a fragment no lookup reaches: it holds disk and is never read.
Plain LRU made exactly those: a chain is written head first (the tier admits
a page only after its parent), so its head is its oldest file and went
first, leaving the rest of the chain behind it unreachable. Here eviction
starts from the least recently used page but removes a leaf under it (a page
no other held page continues), so a chain shrinks from its end and what
stays is always reachable.

Parents are known from the writes (the host tier hands each page over with
its parent) and, across a restart, from the file names: a page's file is
named `<hash>-<parent>` (just `<hash>` for a chain's head, and for files of
older versions, whose parent is unknown: those are evicted as leaves).

Not thread-safe: DiskTier calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from engine.kv.block_hash import ROOT_HASH

HASH_BYTES = 16


def file_name(page_hash: bytes, parent: bytes | None) -> str:
    """A page file's name: its hash, and its parent's unless it has none."""
    if parent is None or parent == ROOT_HASH:
        return page_hash.hex()
    return f"{page_hash.hex()}-{parent.hex()}"


def parse_file_name(name: str) -> tuple[bytes, bytes | None] | None:
    """(hash, parent or None) of a page file's name; None for another file."""
    hashed, _, parent = name.partition("-")
    try:
        page_hash = bytes.fromhex(hashed)
        parent_hash = bytes.fromhex(parent) if parent else None
    except ValueError:
        return None
    if len(page_hash) != HASH_BYTES or (parent_hash is not None and len(parent_hash) != HASH_BYTES):
        return None
    return page_hash, parent_hash


class ChainIndex:
    def __init__(self) -> None:
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._parent: dict[bytes, bytes] = {}
        # Held pages that continue each page (insertion-ordered: a dict as a set).
        self._children: dict[bytes, dict[bytes, None]] = {}
        # The path from the least recently used page down towards a leaf,
        # kept between evictions (a chain is evicted one leaf at a time).
        self._descent: list[bytes] = []
        self.total_bytes = 0

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[bytes]:
        """Least recently used first."""
        return iter(self._sizes)

    def name(self, page_hash: bytes) -> str:
        return file_name(page_hash, self._parent.get(page_hash))

    def add(self, page_hash: bytes, size: int, parent: bytes | None) -> None:
        """A page now on disk, most recently used (parent None: unknown or a head)."""
        if page_hash in self._sizes:
            self.touch(page_hash)
            return
        self._sizes[page_hash] = size
        self.total_bytes += size
        if parent is not None and parent != ROOT_HASH:
            self._parent[page_hash] = parent
            self._children.setdefault(parent, {})[page_hash] = None

    def touch(self, page_hash: bytes) -> None:
        """A page used: most recently used now."""
        if page_hash in self._sizes:
            self._sizes.move_to_end(page_hash)

    def remove(self, page_hash: bytes) -> int | None:
        """Forget a page (its file is gone or damaged); its size, or None."""
        if page_hash in self._descent:
            self._descent.clear()
        return self._unlink(page_hash)

    def remove_chain_from(self, page_hash: bytes) -> list[str]:
        """Forget a page and every held page after it (a lookup stops where
        the page is gone, so those would be fragments); their file names."""
        found = [page_hash] if page_hash in self._sizes else []
        for page in found:  # grows as it goes
            found.extend(self._children.get(page, ()))
        names = [self.name(page) for page in found]
        for page in reversed(found):
            self.remove(page)
        return names

    def fragments(self) -> list[bytes]:
        """Pages no lookup can reach: a known parent not held, or a
        descendant of such a page (after a crash, or files removed by hand)."""
        found = [page for page, parent in self._parent.items() if parent not in self._sizes]
        for page in found:  # grows as it goes: each one's descendants too
            found.extend(self._children.get(page, ()))
        return found

    def _unlink(self, page_hash: bytes) -> int | None:
        size = self._sizes.pop(page_hash, None)
        if size is None:
            return None
        self.total_bytes -= size
        parent = self._parent.pop(page_hash, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.pop(page_hash, None)
                if not siblings:
                    del self._children[parent]
        return size

    def evict(self) -> tuple[bytes, str]:
        """Remove the page the budget should lose next: a leaf under the
        least recently used page. Returns its hash and file name."""
        head = next(iter(self._sizes))
        descent = self._descent
        if not descent or descent[0] != head:
            descent[:] = [head]
        while children := self._children.get(descent[-1]):
            descent.append(next(iter(children)))
        victim = descent.pop()
        name = self.name(victim)
        self._unlink(victim)
        return victim, name
