"""Threads that read the disk tier's page files into host slots, off the
engine's loop (engine/kv/disk_restore.py hands them the reads).

Ownership: a reader thread touches the page file and the bytes of the host
slot its job names (reserved for it by the engine thread: no copy and no
other page uses that slot meanwhile), and nothing else; every index, pool
and counter stays with the engine thread, which takes finished jobs with
take_done(). Every job submitted comes back exactly once, read or skipped,
so the engine thread always learns what became of its reserved slot.

Reading a file (readinto) and its BLAKE2b checksum (hashlib, on buffers
this large) release the GIL, so reads overlap the engine's Python work as
well as its device work.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.kv.disk_pages import PageRead, read_page

log = logging.getLogger(__name__)

# Readers: one page is read and checked by each at a time. Measured on the
# H200's host with two readers and BLAKE2b pages: restores at 0.3-0.4 GB/s,
# far below the disk; with CRC-32 pages (disk_pages.py) a page costs a read
# and a pass at 4-5 GB/s, and four readers keep more reads in flight
# without taking the host's every core.
READER_THREADS = 4
# How long close() waits for a read in progress (one page: milliseconds on
# a working disk) before leaving its daemon thread behind.
CLOSE_WAIT_SECONDS = 2.0


class SlotViews(Protocol):
    def slot_view(self, slot: int) -> memoryview: ...


# A page's (tokens, bytes) while its write is pending (DiskTier.unwritten).
Unwritten = Callable[[bytes], "tuple[tuple[int, ...], bytes] | None"]


class RestoreState(Protocol):
    """What a reader asks of the restore a job belongs to."""

    @property
    def ended(self) -> bool: ...

    @property
    def deadline(self) -> float: ...

    @property
    def cut(self) -> int:
        """Pages past this index are not wanted (one before them failed)."""
        ...


@dataclass(eq=False)
class ReadJob:
    """One page to read into one reserved host slot."""

    restore: RestoreState
    index: int  # among the restore's pages, in prefix order
    page_hash: bytes
    tokens: tuple[int, ...]
    slot: int
    # Set by the reader: the outcome (None: skipped, its restore ended or
    # past its deadline, or the reader closed), the seconds it took, and
    # whether the bytes came from the writer's queue rather than the file.
    status: PageRead | None = None
    seconds: float = 0.0
    from_memory: bool = False


class DiskReader:
    def __init__(self, directory: Path, kv_format: bytes, memory: SlotViews,
                 unwritten: Unwritten, path_of: Callable[[bytes], Path],
                 threads: int = READER_THREADS) -> None:
        self.directory = directory
        self.path_of = path_of  # a page's file (its name carries its parent)
        self.kv_format = kv_format
        self.memory = memory
        self.unwritten = unwritten
        self._lock = threading.Condition()
        self._jobs: deque[ReadJob] = deque()
        self._done: list[ReadJob] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._read_loop, name=f"disk-kv-reader-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, jobs: list[ReadJob]) -> None:
        with self._lock:
            if self._closed:
                self._done.extend(jobs)  # skipped
            else:
                self._jobs.extend(jobs)
            self._lock.notify_all()

    def take_done(self) -> list[ReadJob]:
        """Jobs finished (read or skipped) since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, timeout: float) -> bool:
        """Wait (at most timeout seconds) until a job is done; whether one is."""
        with self._lock:
            return self._lock.wait_for(lambda: bool(self._done), timeout)

    def _read_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            restore = job.restore
            if (not restore.ended and job.index <= restore.cut
                    and time.monotonic() < restore.deadline):
                self._read(job)
            with self._lock:
                self._done.append(job)
                self._lock.notify_all()

    def _read(self, job: ReadJob) -> None:
        started = time.monotonic()
        path = self.path_of(job.page_hash)
        try:
            into = self.memory.slot_view(job.slot)
            pending = self.unwritten(job.page_hash)
            if pending is not None:
                # Evicted from the host tier moments ago; its file is not
                # written yet (checked first: the file appears before the
                # page leaves the writer's hands).
                tokens, payload = pending
                same = tokens == job.tokens and len(payload) == into.nbytes
                if same:
                    into[:] = payload
                job.status, job.from_memory = (PageRead.OK if same else PageRead.MISSING), True
                job.seconds = time.monotonic() - started
                return
            job.status = read_page(path, self.kv_format, job.page_hash, job.tokens, into)
        except OSError as exc:
            # A failing disk (EIO, a directory gone): a miss, as a torn file is.
            log.warning("disk KV tier: cannot read %s (%s); its tokens are computed", path, exc)
            job.status = PageRead.MISSING
        except Exception:
            # Whatever went wrong, the job comes back (its slot is freed) and
            # the reader lives on: serving must not depend on the disk.
            log.exception("disk KV tier: reading %s failed; its tokens are computed", path)
            job.status = PageRead.MISSING
        if job.status is PageRead.OK:
            try:
                os.utime(path)  # most recently used, after a restart too
            except OSError:
                pass  # evicted meanwhile: its bytes are read already
        job.seconds = time.monotonic() - started

    def close(self) -> None:
        """Skip the jobs not started, wait for those in progress, stop."""
        with self._lock:
            self._closed = True
            self._done.extend(self._jobs)
            self._jobs.clear()
            self._lock.notify_all()
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                log.warning("disk KV tier: a page read did not finish in %gs at close",
                            CLOSE_WAIT_SECONDS)

    @property
    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)
