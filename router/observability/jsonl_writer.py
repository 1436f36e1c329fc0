"""An append-only JSON Lines file written by its own thread, rotated by size.

The event loop hands each line (already encoded) to a bounded queue and goes
on; the writer thread drains the queue and writes whatever it found with one
write() call, so every event reaches the operating system as soon as the
thread runs, and a slow or stalled disk (NFS, a full volume) never stalls
requests. Nothing is lost silently: a line that finds the queue full, or
whose write fails, is counted, and the next line that can be written is
preceded by an `events_dropped` event with the count (and a warning on the
operational log).

Rotation (logrotate's numbering): past `max_bytes` the file becomes FILE.1,
FILE.1 becomes FILE.2, ... up to FILE.`keep`; the oldest falls off.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

# Lines that may wait for the writer thread: a few seconds of a busy
# server's events, a few MiB at most.
QUEUE_LINES = 10_000
# How long close() waits for the thread to write what is queued.
CLOSE_SECONDS = 10.0
# After a failed write or open, the thread waits this long before the next
# try: a full disk fails every write the same way.
RETRY_SECONDS = 0.1


class JsonlWriter:
    def __init__(self, path: Path, max_bytes: int, keep: int, *,
                 queue_lines: int = QUEUE_LINES,
                 dropped_line: Callable[[int, int], bytes] | None = None):
        """`dropped_line(count, total)` encodes the line that reports drops."""
        if max_bytes < 1 or keep < 1:
            raise ValueError("the request log needs max_bytes >= 1 and keep >= 1")
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.queue_lines = queue_lines
        # Counted on the event loop's thread (queue full) and the writer's
        # (write failed); each counter has one writer, so no lock.
        self.dropped_full = 0
        self.dropped_failed = 0
        # Drops written to the file as events_dropped, and the total the
        # report being written carries.
        self._reported = 0
        self._report_total = 0
        self._dropped_line = dropped_line
        # Whether the last write failed: its warning is said once.
        self._failing = False
        # None asks the thread to finish.
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._closed = False
        # Opened here, so a path that cannot be written fails the start-up.
        self._file: BinaryIO | None = self._open()
        self._size = self._file.tell()
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()
        # A router that dies without close() still writes what it queued.
        atexit.register(self.close)

    @property
    def dropped(self) -> int:
        return self.dropped_full + self.dropped_failed

    def write(self, line: bytes) -> None:
        """Queue one line (ending in a newline); never blocks."""
        # qsize() may be off by a line under a race; the bound only needs to
        # hold roughly.
        if self._closed or self._queue.qsize() >= self.queue_lines:
            self.dropped_full += 1
            return
        self._queue.put(line)

    def close(self, last: bytes | None = None, timeout: float = CLOSE_SECONDS) -> None:
        """Write what is queued and then `last` (past the queue's bound: the
        final word is never dropped), then close the file; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if last is not None:
            self._queue.put(last)
        self._queue.put(None)
        self._thread.join(timeout)
        atexit.unregister(self.close)

    # ---- the writer thread ------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = None in batch
            self._write_lines([line for line in batch if line is not None])
        if self._file is not None:
            self._file.close()

    def _write_lines(self, lines: list[bytes]) -> None:
        report = self._drop_report()
        if report is not None:
            lines = [report, *lines]
        chunk: list[bytes] = []
        chunk_bytes = 0
        for line in lines:
            filled = self._size + chunk_bytes
            if filled and filled + len(line) > self.max_bytes:
                self._write_chunk(chunk, report)
                chunk, chunk_bytes = [], 0
                self._rotate()
            chunk.append(line)
            chunk_bytes += len(line)
        self._write_chunk(chunk, report)

    def _drop_report(self) -> bytes | None:
        """The events_dropped line for drops not reported yet, if any."""
        self._report_total = self.dropped
        if self._report_total == self._reported or self._dropped_line is None:
            return None
        return self._dropped_line(self._report_total - self._reported, self._report_total)

    def _write_chunk(self, chunk: list[bytes], report: bytes | None) -> None:
        if not chunk:
            return
        data = memoryview(b"".join(chunk))
        try:
            if self._file is None:
                self._file = self._open()
                self._size = self._file.tell()
            # An unbuffered file may take part of a write (a signal, a
            # nearly full disk); the rest follows.
            while data:
                written = self._file.write(data) or 0
                self._size += written
                data = data[written:]
        except OSError as exc:
            # Whole events count as lost even if part of one was written; the
            # report itself is not an event, and is tried again next time.
            self.dropped_failed += sum(line is not report for line in chunk)
            if not self._failing:
                self._failing = True
                log.warning("request log: cannot write %s: %s; counting the events lost",
                            self.path, exc)
            time.sleep(RETRY_SECONDS)
            return
        self._failing = False
        if report is not None and any(line is report for line in chunk):
            count, self._reported = self._report_total - self._reported, self._report_total
            log.warning("request log: %d event(s) were lost (%d in all): the writer fell behind "
                        "or the file could not be written", count, self._reported)

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        try:
            for number in range(self.keep - 1, 0, -1):
                older = self._numbered(number)
                if older.exists():
                    os.replace(older, self._numbered(number + 1))
            os.replace(self.path, self._numbered(1))
        except OSError as exc:
            # Writing goes on into the same file, and the next try comes
            # max_bytes later (the size counts from 0 either way).
            log.warning("request log: cannot rotate %s: %s", self.path, exc)
        self._size = 0
        try:
            self._file = self._open()
        except OSError:
            pass  # the next write tries again, and counts what it cannot write

    def _numbered(self, number: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{number}")

    def _open(self) -> BinaryIO:
        # Unbuffered: each write() goes straight to the operating system, so
        # a crash loses no event that was written.
        return open(self.path, "ab", buffering=0)  # type: ignore[return-value]
