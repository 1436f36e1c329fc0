"""Which token prefixes the recurrent-state checkpoints hold (hybrid models).

A hybrid model (Qwen3-Next, Qwen3.5) cannot resume a cached prefix from its
KV pages alone: its linear-attention layers need their recurrent state as it
was at the prefix's last token. The engine copies a running sequence's state
row to a checkpoint row at chosen points (engine/scheduling/scheduler.py: a
prompt's end, every --checkpoint-every-n-tokens of a long prompt, and where a
request finishes or is preempted); a later request whose tokens start with a
checkpoint's prefix, and whose KV pages for that prefix are still cached,
resumes from the deepest such checkpoint.

A checkpoint at prefix length P is keyed as the prefix cache keys a partial
page: the hash of the chain of its full pages (engine/kv/block_hash.py) and
the tokens after them (fewer than a page). Least recently used checkpoints
make room for new ones; with a host tier (--host-kv-mib) the one that makes
room moves to a host row instead of going (and the least recently used host
one goes), and a prompt may resume from a host checkpoint too. Pure
bookkeeping: the rows live in engine/execution/recurrent_state.py and are
copied (RowCopy) on the device's stream in step order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.kv.block_hash import ROOT_HASH, hash_page

Key = tuple[bytes, tuple[int, ...]]


class RowCopy(NamedTuple):
    """A copy of one state row: device rows of the pools unless marked host."""

    src: int
    dst: int
    src_host: bool = False
    dst_host: bool = False


class Place(NamedTuple):
    """Where a checkpoint is: its index among the device's or the host's."""

    host: bool
    index: int


@dataclass
class CheckpointCounters:
    saved: int = 0  # checkpoints written
    restored: int = 0  # admissions that resumed from one
    restored_tokens: int = 0  # the prefix tokens those skipped
    restored_from_host: int = 0  # of those admissions, from a host checkpoint
    moved_to_host: int = 0  # device checkpoints that made room by moving to the host
    evicted: int = 0  # dropped to make room


class StateCheckpoints:
    def __init__(self, count: int, page_size: int, fingerprint: bytes,
                 host_count: int = 0) -> None:
        self.count = count
        self.host_count = host_count
        self.page_size = page_size
        self.fingerprint = fingerprint
        self._free: dict[bool, list[int]] = {}
        # Registered checkpoints per tier, least recently used first: index -> key.
        self._lru: dict[bool, OrderedDict[int, Key]] = {}
        # parent hash -> {tail tokens: where}
        self._by_parent: dict[bytes, dict[tuple[int, ...], Place]] = {}
        self.counters = CheckpointCounters()
        self.clear()

    def __len__(self) -> int:
        return len(self._lru[False]) + len(self._lru[True])

    def key(self, token_ids: Sequence[int], length: int, block_hashes: Sequence[bytes]) -> Key:
        """The key of token_ids[:length] (all known tokens); block_hashes are
        the hashes of the sequence's first full pages, as far as committed:
        the rest of the chain is hashed here."""
        ps = self.page_size
        full = length // ps
        parent = block_hashes[full - 1] if 0 < full <= len(block_hashes) else ROOT_HASH
        if full > len(block_hashes):
            parent = block_hashes[-1] if block_hashes else ROOT_HASH
            for index in range(len(block_hashes), full):
                parent = hash_page(parent, token_ids[index * ps : (index + 1) * ps],
                                   self.fingerprint)
        return parent, tuple(token_ids[full * ps : length])

    def save(self, key: Key) -> tuple[int | None, tuple[int, int] | None]:
        """(a device checkpoint index to copy a state of prefix key into, now
        registered under key; and, when the checkpoint that made room for it
        moves to the host, (its device index, its host index): that copy must
        run first). (None, None) when there is none to give (count 0) or the
        key is held already (that checkpoint becomes the most recent)."""
        held = self._by_parent.get(key[0], {}).get(key[1])
        if held is not None:
            self._lru[held.host].move_to_end(held.index)
            return None, None
        moved = None
        if self._free[False]:
            index = self._free[False].pop()
        elif self._lru[False]:
            index, old = self._lru[False].popitem(last=False)
            host_index = self._take(True)
            if host_index is None:
                self._unlink(old)
                self.counters.evicted += 1
            else:
                self._lru[True][host_index] = old
                self._by_parent[old[0]][old[1]] = Place(True, host_index)
                self.counters.moved_to_host += 1
                moved = (index, host_index)
        else:
            return None, None
        self._lru[False][index] = key
        self._by_parent.setdefault(key[0], {})[key[1]] = Place(False, index)
        self.counters.saved += 1
        return index, moved

    def _take(self, host: bool) -> int | None:
        """A free index of a tier, or its least recently used one's (dropped)."""
        if self._free[host]:
            return self._free[host].pop()
        if not self._lru[host]:
            return None
        index, old = self._lru[host].popitem(last=False)
        self._unlink(old)
        self.counters.evicted += 1
        return index

    def _unlink(self, key: Key) -> None:
        tails = self._by_parent[key[0]]
        del tails[key[1]]
        if not tails:
            del self._by_parent[key[0]]

    def find(self, token_ids: Sequence[int], page_hashes: Sequence[bytes],
             limit: int) -> tuple[int, Place] | None:
        """(prefix length, where) of the deepest checkpoint whose prefix
        starts token_ids and ends within the first `limit` tokens (the KV
        that is cached for them); page_hashes are the hashes of token_ids'
        cached full pages. None when no checkpoint matches."""
        ps = self.page_size
        for full in range(min(len(page_hashes), limit // ps), -1, -1):
            tails = self._by_parent.get(page_hashes[full - 1] if full else ROOT_HASH)
            if not tails:
                continue
            start = full * ps
            best: tuple[int, Place] | None = None
            for tail, place in tails.items():
                length = start + len(tail)
                if (0 < length <= limit and (best is None or length > best[0])
                        and tuple(token_ids[start:length]) == tail):
                    best = (length, place)
            if best is not None:
                self._lru[best[1].host].move_to_end(best[1].index)
                return best
        return None

    def clear(self) -> None:
        self._free = {False: list(range(self.count - 1, -1, -1)),
                      True: list(range(self.host_count - 1, -1, -1))}
        self._lru = {False: OrderedDict(), True: OrderedDict()}
        self._by_parent.clear()

    def check_invariants(self) -> None:
        for host, count in ((False, self.count), (True, self.host_count)):
            assert len(self._free[host]) + len(self._lru[host]) == count
            assert not set(self._free[host]) & set(self._lru[host])
        assert sum(len(tails) for tails in self._by_parent.values()) == len(self)
        for host in (False, True):
            for index, (parent, tail) in self._lru[host].items():
                assert self._by_parent[parent][tail] == Place(host, index)
                assert len(tail) < self.page_size
