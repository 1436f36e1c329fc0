"""The disk tier of the prefix cache: pages the host tier evicts, kept in
files that outlive the engine (--disk-kv-path, --disk-kv-mib).

Files live under DIR/<model artifact digest>/<KV format digest>/, one per
page, named by the page's prefix digest in hex (engine/kv/block_hash.py) and
its parent's (`<hash>-<parent>`; a chain's head has no parent part), in the
format of engine/kv/disk_pages.py; so a model or KV format never reads
another's pages, and a page shared by many prompts is stored once. The tier
keeps its byte budget by evicting chains from their ends, starting under
the least recently used page (engine/kv/disk_chains.py: the parent links
keep every file reachable); at start it scans its directory (order from the
files' mtimes, which a hit refreshes; parents from the names) and deletes
the fragments a crash or a hand left behind.

Writes: HostTier offers each page it evicts (on_evict); the page's bytes are
copied out of the host slot at once (the slot is about to be reused) and
one of WRITER_THREADS writer threads writes them to a temporary name and
renames it. A write that
fails (a full disk: ENOSPC) drops the page, counted and logged once; serving
goes on. Pages still resident in the host tier at shutdown are written too,
each chain head first, most recently used chains first, for at most
SHUTDOWN_WRITE_SECONDS.

Admission follows the chains: a lookup walks a prompt page by page, so a page
is worth a file only if every page before it can be found. The host tier
evicts far faster than a disk writes (measured on the H200: ~2 GB/s against
~190 MB/s), and a page dropped for a full queue used to leave the pages
after it written as fragments no lookup reaches (3,331 pages written, 28,434
dropped, 7,440 tokens of 706k served after a restart). So a page is admitted
only when it starts a chain (its parent is ROOT_HASH) or its parent is on
disk or queued; any other is an orphan, counted and not written, and the
bandwidth goes to chains that can complete. The host tier lets chains leave
head first for this (engine/kv/host_tier.py _parent_first). A page waiting
for the writer is found all the same (find()) and read from its copy in
memory (unwritten()): evicted from the host tier a moment before a request
wants it, it is not missed for want of its file.

Reads: admission finds pages here after the device and the host tier (in
the index: nothing is read to decide whether a request fits). Once the
request fits, reader threads (engine/kv/disk_reader.py, owned here) read
them into reserved host slots while the engine goes on stepping the other
requests, and the request waits (engine/kv/disk_restore.py) until they are
read or its deadline (--disk-kv-restore-ms) passes; the pages read then take
the host tier's path to the device, the rest are computed. The engine
thread settles each read here (settle()): a file that is torn, truncated,
altered or foreign reads as a miss and is deleted.

No torch here: the host slots' bytes come through SlotMemory
(engine/execution/host_kv.py HostKVPool).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.kv.block_hash import ROOT_HASH, parents_first
from engine.kv.disk_chains import ChainIndex, file_name, parse_file_name
from engine.kv.disk_pages import PageRead, file_bytes, page_header
from engine.kv.disk_reader import DiskReader
from engine.kv.host_tier import HostTier, copy_counters
from protocol import EngineStats

log = logging.getLogger(__name__)

# How long a shutdown (or unload) may spend writing the host tier's pages;
# below the router's --stop-timeout default (10 s), after which it terminates
# the engine.
SHUTDOWN_WRITE_SECONDS = 5.0
# Page bytes waiting for the writer thread at most; a page evicted beyond
# that (the disk slower than the evictions) is dropped, and counted.
WRITE_QUEUE_BYTES = 256 * 2**20
# Writer threads sharing the queue. One thread was bound by the page
# checksum when it was BLAKE2b (~430 MB/s on a slow server core, below a
# 1.5 GB/s disk, and the host tier evicts ~2 GB/s under load); CRC-32 and
# file writes release the GIL on large buffers, so four run in parallel.
WRITER_THREADS = 4
# The interpreter's switch interval while a disk tier runs. A thread that
# wants the GIL back after a hash or a write waits until the busy engine loop
# yields it, at most this long; measured on the H200's host (4 writers, a
# busy main thread): 210 MB/s at Python's default 5 ms, 523 MB/s at 1 ms,
# 724 at 0.2 ms, 873 with the main thread idle. The engine loop loses a GIL
# hand-off (microseconds) per switch, only while other threads want it.
GIL_SWITCH_SECONDS = 0.0005
# A temporary file older than this at load was left by a write cut short.
STALE_TEMPORARY_SECONDS = 60.0
# Bumped when the layout of a page's K/V in a host slot changes.
KV_LAYOUT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json")


class SlotMemory(Protocol):
    """The host tier's memory, as bytes (after the copies queued on it)."""

    def slot_bytes(self, slot: int) -> bytes: ...

    def slot_view(self, slot: int) -> memoryview: ...


@dataclass
class DiskCounters:
    """What the tier did since the engine started (EngineStats disk_kv_*)."""

    # Pages (and their tokens) admissions read from here, counted by
    # KVManager once per admission (not as the host tier's hits too).
    hit_pages: int = 0
    hit_tokens: int = 0
    # Admissions whose lookup stopped at a page no tier held (or could read).
    misses: int = 0
    written_pages: int = 0
    evicted_pages: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    # Files found torn, truncated, altered or foreign, and deleted.
    corrupt_pages: int = 0
    # Pages not written: the disk full or failing, or the writer behind.
    dropped_pages: int = 0
    # Pages not written because their parent was not on disk (nor queued):
    # no lookup could reach them. Offered pages are written, dropped,
    # orphans, or held already.
    orphan_pages: int = 0
    # Restores cut short by --disk-kv-restore-ms.
    deadline_hits: int = 0
    # Restores not started: judged slower than computing the same tokens
    # (engine/kv/restore_cost.py); the prefix was computed from its first
    # disk page on (each also counted in misses).
    skipped: int = 0
    # Seconds requests waited for their restores (start to end, summed; the
    # reads run off the engine's loop, which steps the others meanwhile).
    restore_seconds: float = 0.0


def artifact_digest(model_path: Path) -> str:
    """A digest of the model's files as they are: names, sizes, mtimes (its
    weights are never read for this; a file rewritten in place changes it)."""
    path = model_path.resolve()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    facts = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.blake2b(repr((str(path), facts)).encode(), digest_size=16).hexdigest()


def format_digest(dtype: str, page_size: int, num_layers: int, num_kv_heads: int,
                  head_dim: int) -> bytes:
    """A digest of what a page's bytes mean."""
    facts = (KV_LAYOUT_VERSION, dtype, page_size, num_layers, num_kv_heads, head_dim)
    return hashlib.blake2b(repr(facts).encode(), digest_size=16).digest()


def tier_directory(root: Path, artifact: str, kv_format: bytes) -> Path:
    return root / artifact / kv_format.hex()


class DiskTier:
    def __init__(self, directory: Path, *, kv_format: bytes, page_size: int, page_bytes: int,
                 budget_bytes: int, restore_seconds: float, memory: SlotMemory) -> None:
        self.directory = directory
        self.kv_format = kv_format
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.file_bytes = file_bytes(page_size, page_bytes)
        if budget_bytes < self.file_bytes:
            raise ValueError(f"the disk KV budget ({budget_bytes} bytes) holds not even one "
                             f"page file ({self.file_bytes} bytes)")
        self.budget_bytes = budget_bytes
        self.restore_seconds = restore_seconds
        self.memory = memory
        self.counters = DiskCounters()
        self._lock = threading.Condition()
        # The pages on disk: sizes, least recently used order, parents.
        self._index = ChainIndex()
        # (parent hash, hash, tokens, bytes) of each page waiting for a writer.
        self._queue: deque[tuple[bytes, bytes, tuple[int, ...], bytes]] = deque()
        self._queued_bytes = 0
        # Pages queued or being written: found (find()) and read (unwritten())
        # from memory until their file is in place.
        self._unwritten: dict[bytes, tuple[tuple[int, ...], bytes]] = {}
        # Writer threads inside a write (flush() waits for them too).
        self._writing = 0
        self._closed = False
        self._failures_logged: set[int] = set()
        directory.mkdir(parents=True, exist_ok=True)
        self._scan()
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_SECONDS))
        self._writers = [threading.Thread(target=self._write_loop, name=f"disk-kv-writer-{i}",
                                          daemon=True) for i in range(WRITER_THREADS)]
        for writer in self._writers:
            writer.start()
        self.reader = DiskReader(directory, kv_format, memory, self.unwritten, self.file_path)

    # ---- the index -------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        return len(self._index)

    @property
    def cached_bytes(self) -> int:
        return self._index.total_bytes

    def file_path(self, page_hash: bytes) -> Path:
        """Where a held page's file is (a page not held: its head name)."""
        with self._lock:
            return self.directory / self._index.name(page_hash)

    def _scan(self) -> None:
        """Find the pages a run before left; LRU order from their mtimes."""
        found: list[tuple[int, bytes, int]] = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tmp"):
                # A write cut short by an exit (a recent one may be another
                # engine's, of the same model, writing now).
                if time.time() - entry.stat().st_mtime > STALE_TEMPORARY_SECONDS:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            named = parse_file_name(entry.name)
            if named is not None and entry.is_file():
                stat = entry.stat()
                found.append((stat.st_mtime_ns, named[0], named[1], stat.st_size))
        # By mtime, then hash (a parent may be None: never compared).
        for _, page_hash, parent, size in sorted(found, key=lambda e: (e[0], e[1])):
            self._index.add(page_hash, size, parent)
        fragments = self._index.fragments()
        for page_hash in fragments:
            path = self.directory / self._index.name(page_hash)
            self._index.remove(page_hash)
            path.unlink(missing_ok=True)
        self._evict_over_budget()
        log.info("disk KV tier: %d pages (%.1f MiB of %.1f MiB) found in %s%s", len(self._index),
                 self._index.total_bytes / 2**20, self.budget_bytes / 2**20, self.directory,
                 f"; {len(fragments)} pages whose chain was broken deleted" if fragments else "")

    def find(self, page_hash: bytes) -> bool:
        with self._lock:
            return page_hash in self._index or page_hash in self._unwritten

    def unwritten(self, page_hash: bytes) -> tuple[tuple[int, ...], bytes] | None:
        """A page's tokens and bytes while it waits for the writer (or is
        being written), for a reader: a page just evicted from the host tier
        is read back from memory, not missed for want of its file."""
        with self._lock:
            return self._unwritten.get(page_hash)

    def cached_hashes(self) -> list[bytes]:
        """Hashes held, least recently used first."""
        with self._lock:
            return list(self._index)

    def _evict_over_budget(self) -> None:
        while True:
            with self._lock:
                if self._index.total_bytes <= self.budget_bytes or not len(self._index):
                    return
                _, name = self._index.evict()
                self.counters.evicted_pages += 1
            (self.directory / name).unlink(missing_ok=True)

    # ---- writes ----------------------------------------------------------------

    def has_room(self) -> bool:
        """The write queue would take a page now (HostTier's eviction order)."""
        with self._lock:
            return not self._closed and self._queued_bytes + self.page_bytes <= WRITE_QUEUE_BYTES

    def continues(self, parent: bytes) -> bool:
        """A page after parent would be admitted: parent starts no chain
        (ROOT_HASH) or is on disk or queued."""
        with self._lock:
            return self._continues(parent)

    def _continues(self, parent: bytes) -> bool:
        return parent == ROOT_HASH or parent in self._index or parent in self._unwritten

    def spill(self, slot: int, parent: bytes, page_hash: bytes, tokens: tuple[int, ...]
              ) -> None:
        """HostTier.on_evict: a page leaving the host tier; its bytes are
        still in the slot, and copied out now if it continues a chain here."""
        with self._lock:
            if page_hash in self._index:
                self._index.touch(page_hash)
                return
            if page_hash in self._unwritten:
                return
            if not self._continues(parent):
                self.counters.orphan_pages += 1
                return
            if self._closed or self._queued_bytes + self.page_bytes > WRITE_QUEUE_BYTES:
                self.counters.dropped_pages += 1
                return
            self._queued_bytes += self.page_bytes
        payload = self.memory.slot_bytes(slot)
        with self._lock:
            self._queue.append((parent, page_hash, tokens, payload))
            self._unwritten[page_hash] = (tokens, payload)
            self._lock.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                parent, page_hash, tokens, payload = self._queue.popleft()
                # Its parent's write failed, or its file was evicted, since
                # it was queued: the page would be a fragment.
                orphan = not self._continues(parent)
                if orphan:
                    self.counters.orphan_pages += 1
                self._writing += 1
            try:
                if not orphan:
                    self._write(parent, page_hash, tokens, payload)
            finally:
                with self._lock:
                    self._writing -= 1
                    self._queued_bytes -= len(payload)
                    self._unwritten.pop(page_hash, None)
                    self._lock.notify_all()

    def _write(self, parent: bytes, page_hash: bytes, tokens: Sequence[int], payload: bytes
               ) -> None:
        with self._lock:
            if page_hash in self._index:
                return
        path = self.directory / file_name(page_hash, parent)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        header = page_header(self.kv_format, page_hash, tokens, payload)
        try:
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(payload)
            # No fsync: a file torn by a power cut fails its checksum later.
            os.replace(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            with self._lock:
                self.counters.dropped_pages += 1
            code = exc.errno or 0
            if code not in self._failures_logged:
                self._failures_logged.add(code)
                log.warning("disk KV tier: cannot write a page to %s (%s)%s; such pages are "
                            "dropped, serving goes on (logged once)", self.directory, exc,
                            ": the disk is full" if code == errno.ENOSPC else "")
            return
        size = len(header) + len(payload)
        with self._lock:
            self._index.add(page_hash, size, parent)
            self.counters.written_pages += 1
            self.counters.bytes_written += size
        self._evict_over_budget()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued page is written (at most timeout seconds)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queue or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def persist(self, host: HostTier, seconds: float = SHUTDOWN_WRITE_SECONDS) -> None:
        """At shutdown: write what waits in the queue, then the pages resident
        in the host tier that the disk lacks, under spill's rule, each after
        its parent and the most recently used chains first, for at most
        `seconds` in all; then stop the writer."""
        started = time.monotonic()
        deadline = started + seconds
        self.flush(seconds)
        self.close()
        lacking = [entry for entry in reversed(host.resident()) if not self.find(entry[2])]
        resident = [lacking[i] for i in parents_first([(e[1], e[2]) for e in lacking])]
        written = orphans = 0
        for slot, parent, page_hash, tokens in resident:
            if time.monotonic() >= deadline:
                break
            with self._lock:
                orphan = not self._continues(parent)
                if orphan:
                    self.counters.orphan_pages += 1
            if orphan:
                orphans += 1
                continue
            self._write(parent, page_hash, tokens, self.memory.slot_bytes(slot))
            written += 1
        left = len(resident) - written - orphans
        log.info("disk KV tier: wrote %d of the host tier's %d pages the disk lacked in "
                 "%.2fs (%d orphans: their chain's head is not on disk)%s", written,
                 len(resident), time.monotonic() - started, orphans,
                 f" ({left} left: the {seconds:g}s bound)" if left else "")

    def close(self) -> None:
        """Stop the readers (reads not started are skipped) and the writer
        threads (the queue is dropped; writes under way finish)."""
        self.reader.close()
        with self._lock:
            self._closed = True
            for _, page_hash, _, _ in self._queue:
                self._unwritten.pop(page_hash, None)
            self._queue.clear()
            self._queued_bytes = 0
            self._lock.notify_all()
        for writer in self._writers:
            writer.join()

    # ---- reads -----------------------------------------------------------------

    def settle(self, page_hash: bytes, status: PageRead | None, from_memory: bool = False
               ) -> None:
        """On the engine thread: the outcome of a reader's read of a page
        (None: skipped; from_memory: its write was still pending). The
        reader refreshed a good file's mtime already."""
        if status is None:
            return
        if status is PageRead.OK:
            if not from_memory:
                self.counters.bytes_read += self.file_bytes
            with self._lock:
                self._index.touch(page_hash)
            return
        with self._lock:
            # The pages after it are fragments now (lookups stop here): gone too.
            names = self._index.remove_chain_from(page_hash)
        for name in names[1:]:
            (self.directory / name).unlink(missing_ok=True)
        if status is PageRead.CORRUPT:
            self.counters.corrupt_pages += 1
            path = self.directory / (names[0] if names else file_name(page_hash, None))
            path.unlink(missing_ok=True)
            log.warning("disk KV tier: page file %s is damaged or foreign; deleted, its "
                        "tokens are computed instead", path.name)

    def report(self, stats: EngineStats) -> None:
        stats.disk_kv_capacity_bytes = self.budget_bytes
        stats.disk_kv_bytes_cached = self._index.total_bytes
        stats.disk_kv_pages_cached = len(self._index)
        copy_counters(self.counters, stats, "disk_kv")
