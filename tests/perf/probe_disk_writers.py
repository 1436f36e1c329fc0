"""Do the disk KV tier's writer threads starve behind a busy engine loop?

    python tests/perf/probe_disk_writers.py [--pages 200] [--dir DIR] [--smoke]

Four threads checksum (CRC-32) and write 2.36 MB pages (the Qwen3-8B
shape's page of 16 tokens) to temporary files, as engine/kv/disk_tier.py's
writers do, while the main thread idles, or spins in pure Python (as the
engine's loop keeps the GIL), at several interpreter switch intervals.
Reports the writers' MB/s for each, and first one core's rate of the
page checksum the tier uses (CRC-32) and of the BLAKE2b it used before.
Measured on the H200's host
with BLAKE2b checksums, this script's first version (docs/performance.md):
873 MB/s idle; busy 210 at the default 5 ms, 523 at
1 ms, 724 at 0.2 ms, which is why a disk tier sets 0.5 ms.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

PAGE_BYTES = 2_359_296
WRITERS = 4


def write_pages(root: Path, count: int, tag: str, payload: bytes) -> None:
    for index in range(count):
        zlib.crc32(payload)
        temporary = root / f"{tag}-{index}.tmp"
        with open(temporary, "wb") as file:
            file.write(b"h" * 128)
            file.write(payload)
        os.replace(temporary, root / f"{tag}-{index}")


def writers_rate(root: Path, pages: int, busy: bool, interval: float, payload: bytes) -> float:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    tag = f"{'busy' if busy else 'idle'}-{interval}"
    threads = [threading.Thread(target=write_pages, args=(root, pages // WRITERS, f"{tag}-{t}",
                                                          payload)) for t in range(WRITERS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    spins = 0
    while any(thread.is_alive() for thread in threads):
        if busy:
            for _ in range(20_000):
                spins += 1
        else:
            time.sleep(0.001)
    seconds = time.perf_counter() - started
    sys.setswitchinterval(previous)
    for path in root.glob(f"{tag}-*"):
        path.unlink()
    return pages // WRITERS * WRITERS * len(payload) / seconds / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary one)")
    parser.add_argument("--smoke", action="store_true", help="a few small pages, seconds")
    args = parser.parse_args()
    page_bytes = 65_536 if args.smoke else PAGE_BYTES
    pages = 8 if args.smoke else args.pages
    payload = os.urandom(page_bytes)
    for name, checksum in (("crc32", lambda: zlib.crc32(payload)),
                           ("blake2b", lambda: hashlib.blake2b(payload, digest_size=32).digest())):
        started, rounds = time.perf_counter(), 4 if args.smoke else 40
        for _ in range(rounds):
            checksum()
        rate = rounds * len(payload) / (time.perf_counter() - started) / 1e6
        print(f"{name}: {rate:,.0f} MB/s on one core", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for busy, interval in ((False, 0.005), (True, 0.005), (True, 0.001), (True, 0.0005),
                               (True, 0.0002)):
            rate = writers_rate(Path(directory), pages, busy, interval, payload)
            print(f"main thread {'busy' if busy else 'idle'}, switch interval "
                  f"{interval * 1000:.1f} ms: writers {rate:,.0f} MB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
