"""Restores from the disk tier, off the engine's loop: a request whose prefix
goes on into the disk waits (not admitted, not holding up the requests
behind it) while reader threads (engine/kv/disk_reader.py) read its pages
into host tier slots; then it is admitted as a host tier hit is, the pages
read counted as the disk's hits. vLLM's KV connectors and llama.cpp's slot
restores let such a request wait in a "loading" state likewise.

Everything here runs on the engine thread: KVManager starts a restore when
the request fits (engine/kv/kv_manager.py; one at a time: a restore keeps
its pages until its request is admitted, and two could keep what both
need), and poll() (each schedule()) takes the reads done: a page read and
checked is registered in the host tier (HostTier.fill) and kept for its
request, on a device page of its own when the pool can spare one
(KVManager.promote), else held in its slot; a page that is torn, damaged
or gone frees its slot, is forgotten by the disk tier, and cuts the
restore there (the pages after it cannot be used: the chain breaks; the
reads before it are still waited for). A restore ends when every page
wanted is read, or at its deadline (--disk-kv-restore-ms): the request is
then admitted with the prefix read so far and computes the rest; a read
still in progress at that point finishes into the host tier as an
ordinary cached page, or frees its slot. Each restore's bytes read over its
wall time are a sample of the disk's read rate (engine/kv/restore_cost.py,
which KVManager asks before starting one).

Reads are submitted a window at a time (READ_AHEAD_BYTES of slots reserved
ahead of the readers), so a long restore into a full host tier evicts host
pages a few steps at a time rather than all at the start, and a restore cut
short by its deadline has reserved little it did not use.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockPool
from engine.kv.disk_pages import PageRead
from engine.kv.disk_reader import READER_THREADS, ReadJob
from engine.kv.disk_tier import DiskTier
from engine.kv.host_tier import HostTier
from engine.kv.restore_cost import RestoreCost

# Host slots reserved for reads not yet done, per restore, at most.
READ_AHEAD_BYTES = 256 * 2**20


@dataclass(eq=False)
class DiskRestore:
    """One waiting request's pages on their way from the disk."""

    started: float
    deadline: float
    # Pages not yet submitted, in prefix order: (hash, tokens).
    to_read: deque[tuple[bytes, tuple[int, ...]]]
    # Each page's parent in the chain (registering it on the device needs it).
    parents: dict[bytes, bytes] = field(default_factory=dict)
    ended: bool = False
    # Jobs submitted and not yet taken back from the readers.
    in_flight: int = 0
    # Pages submitted so far; a page that failed cuts the restore at its
    # index (the pages after it are not wanted: the chain breaks there).
    submitted: int = 0
    cut: int = 2**62
    # Pages read into the host tier for it (counted as the disk's hits).
    read: set[bytes] = field(default_factory=set)
    # Host tier pages kept for it until it is admitted or aborted.
    held: list[bytes] = field(default_factory=list)
    # Device pages of its prefix, referenced meanwhile (as admission will).
    device_pages: list[int] = field(default_factory=list)


# Moves a page read into a host slot on to a device page of its own, cached
# and referenced: (slot, parent hash, hash, tokens) -> the page, or None when
# the pool has no page to spare (KVManager.promote).
Promote = Callable[[int, bytes, bytes, tuple[int, ...]], "int | None"]


class DiskRestores:
    def __init__(self, disk: DiskTier, host: HostTier, pool: BlockPool,
                 promote: Promote | None = None, cost: RestoreCost | None = None) -> None:
        self.disk = disk
        self.host = host
        self.pool = pool
        self.promote = promote
        # Told each restore's bytes read and wall time (its read rate).
        self.cost = cost
        self.read_ahead = max(2 * READER_THREADS, READ_AHEAD_BYTES // disk.page_bytes)
        self._by_request: dict[str, DiskRestore] = {}
        # Jobs handed to the readers and not yet taken back: their slots are
        # reserved in the host tier.
        self._in_flight = 0

    # ---- queries -----------------------------------------------------------------

    def restoring(self, request_id: str) -> bool:
        """The request waits for its pages (not to be admitted yet)."""
        restore = self._by_request.get(request_id)
        return restore is not None and not restore.ended

    @property
    def active(self) -> bool:
        """Some request waits for its pages."""
        return any(not restore.ended for restore in self._by_request.values())

    @property
    def busy(self) -> bool:
        """A restore holds pages for a request not admitted yet."""
        return bool(self._by_request)

    def has(self, request_id: str) -> bool:
        return request_id in self._by_request

    def read_pages(self, request_id: str) -> set[bytes]:
        restore = self._by_request.get(request_id)
        return restore.read if restore is not None else set()

    # ---- a restore's life ------------------------------------------------------------

    def start(self, request_id: str, device_pages: list[int], host_pages: Iterable[bytes],
              disk_pages: list[tuple[bytes, bytes, tuple[int, ...]]]) -> bool:
        """Begin reading disk_pages (the prefix's pages found on disk, in
        order: parent hash, hash, tokens) for a request. The rest of its
        prefix stays where it is while it waits: device_pages are referenced
        (else the other requests' steps could evict them, on to the disk,
        where they would no longer count) and host_pages (hashes) held, so
        the reads' slots never push them out either. False when not one
        slot can be had: nothing started, the disk pages are computed."""
        assert request_id not in self._by_request
        now = time.monotonic()
        restore = DiskRestore(now, now + self.disk.restore_seconds,
                              deque((page_hash, tokens) for _, page_hash, tokens in disk_pages),
                              {page_hash: parent for parent, page_hash, _ in disk_pages})
        self.pool.acquire(device_pages)
        restore.device_pages = list(device_pages)
        for page_hash in host_pages:
            self.host.hold(page_hash)
            restore.held.append(page_hash)
        self._by_request[request_id] = restore
        self._submit(restore)
        if self._stuck(restore):
            self._release(restore)
            del self._by_request[request_id]
            return False
        return True

    def _submit(self, restore: DiskRestore) -> None:
        """Hand the readers the restore's next pages, up to the read-ahead."""
        jobs: list[ReadJob] = []
        while restore.to_read and restore.in_flight + len(jobs) < self.read_ahead:
            slot = self.host.reserve()
            if slot is None:
                break  # every slot held or pinned (until this step's copies are queued)
            page_hash, tokens = restore.to_read.popleft()
            jobs.append(ReadJob(restore, restore.submitted, page_hash, tokens, slot))
            restore.submitted += 1
        restore.in_flight += len(jobs)
        self._in_flight += len(jobs)
        if jobs:
            self.disk.reader.submit(jobs)

    def poll(self) -> None:
        """Take the reads done; end restores that are complete, broken or
        past their deadline; submit the next pages of the others."""
        touched: set[int] = set()
        for job in self.disk.reader.take_done():
            restore = job.restore
            assert isinstance(restore, DiskRestore)
            restore.in_flight -= 1
            self._in_flight -= 1
            self.disk.settle(job.page_hash, job.status, job.from_memory)
            if job.status is PageRead.OK:
                slot = self.host.fill(job.slot, restore.parents[job.page_hash], job.page_hash,
                                      job.tokens)
                if not restore.ended:
                    restore.read.add(job.page_hash)
                    self._keep(restore, slot, job.page_hash, job.tokens)
            else:
                self.host.unreserve(job.slot)
                if job.status is not None:
                    # The chain breaks here: nothing after it is read, but
                    # the reads before it are still waited for.
                    restore.cut = min(restore.cut, job.index)
                    restore.to_read.clear()
            touched.add(id(restore))
        now = time.monotonic()
        for restore in self._by_request.values():
            if restore.ended:
                continue
            if not (restore.in_flight or restore.to_read):
                self._end(restore)  # (every page read counts, however late it came)
                continue
            if now >= restore.deadline:
                self.disk.counters.deadline_hits += 1
                self._end(restore)
                continue
            if id(restore) in touched or not restore.in_flight:
                self._submit(restore)
            if self._stuck(restore):
                self._end(restore)  # no slot for its next page: the prefix ends there

    def _keep(self, restore: DiskRestore, slot: int, page_hash: bytes,
              tokens: tuple[int, ...]) -> None:
        """Keep a page read for its request until admission: on a device
        page of its own when the pool has one to spare (copied there before
        the next forward pass, so its host slot is free again at once and a
        long restore never fills the host tier with held pages), else held
        in its host slot."""
        page = (self.promote(slot, restore.parents[page_hash], page_hash, tokens)
                if self.promote is not None else None)
        if page is not None:
            restore.device_pages.append(page)
        else:
            self.host.hold(page_hash)
            restore.held.append(page_hash)

    def _stuck(self, restore: DiskRestore) -> bool:
        """Nothing in flight, and no host slot for its next page until a
        hold ends (none is merely pinned for this step's copies)."""
        return not restore.in_flight and not self.host.num_pinned

    def _end(self, restore: DiskRestore) -> None:
        restore.ended = True
        restore.to_read.clear()
        seconds = time.monotonic() - restore.started
        self.disk.counters.restore_seconds += seconds
        if self.cost is not None:
            self.cost.note_read(len(restore.read) * self.disk.file_bytes, seconds)

    def finish(self, request_id: str) -> None:
        """The request is admitted (its pages referenced by it now, its read
        ones pinned for their copies to the device) or gone: its holds end.
        Reads of it still in progress finish as ordinary cached pages."""
        restore = self._by_request.pop(request_id, None)
        if restore is None:
            return
        if not restore.ended:
            self._end(restore)
        self._release(restore)

    def _release(self, restore: DiskRestore) -> None:
        for page_hash in restore.held:
            self.host.release(page_hash)
        restore.held.clear()
        self.pool.release(reversed(restore.device_pages))
        restore.device_pages.clear()

    def wait(self, timeout: float) -> None:
        """Wait for a read to finish, at most until timeout seconds or the
        nearest deadline pass (whichever first)."""
        deadlines = [r.deadline for r in self._by_request.values() if not r.ended]
        if deadlines:
            timeout = min(timeout, max(min(deadlines) - time.monotonic(), 0.0))
        self.disk.reader.wait(timeout)

    def close(self) -> None:
        """At shutdown: end every restore, stop the readers (a read in
        progress finishes first) and settle what they did: no slot is left
        reserved and no page half-read is registered."""
        for request_id in list(self._by_request):
            self.finish(request_id)
        self.disk.reader.close()
        self.poll()

    def check_invariants(self) -> None:
        assert self.host.num_reserved == self._in_flight, (
            f"{self.host.num_reserved} host slots reserved for {self._in_flight} disk reads")
        for restore in self._by_request.values():
            assert restore.ended or restore.in_flight or restore.to_read, (
                "a restore waits for nothing")
