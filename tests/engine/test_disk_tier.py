"""The disk tier's files and bookkeeping (engine/kv/disk_tier.py,
engine/kv/disk_pages.py) without a model: host slots are plain bytearrays."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from engine.kv import disk_reader
from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.block_pool import BlockPool
from engine.kv.disk_pages import PageRead, page_header, read_page
from engine.kv.disk_restore import DiskRestores
from engine.kv.disk_tier import WRITER_THREADS, DiskTier
from engine.kv.host_tier import HostTier
from engine.kv.kv_manager import KVManager
from engine.scheduling.sequence import Sequence
from protocol import CacheHits, SamplingParams

PAGE = 2
PAGE_BYTES = 64
FORMAT = b"F" * 16


class Slots:
    def __init__(self, count: int) -> None:
        self.memory = [bytearray(PAGE_BYTES) for _ in range(count)]

    def slot_bytes(self, slot: int) -> bytes:
        return bytes(self.memory[slot])

    def slot_view(self, slot: int) -> memoryview:
        return memoryview(self.memory[slot])


def h(n: int) -> bytes:
    return n.to_bytes(16, "big")


def tokens(n: int) -> tuple[int, ...]:
    return (n, n + 1)


def make_tier(directory: Path, pages: int, slots: Slots, restore_seconds: float = 10.0
              ) -> DiskTier:
    probe = page_header(FORMAT, h(0), tokens(0), bytes(PAGE_BYTES))
    return DiskTier(directory, kv_format=FORMAT, page_size=PAGE, page_bytes=PAGE_BYTES,
                    budget_bytes=pages * (len(probe) + PAGE_BYTES),
                    restore_seconds=restore_seconds, memory=slots)


def spill(tier: DiskTier, slots: Slots, n: int) -> None:
    slots.memory[0][:] = bytes([n]) * PAGE_BYTES
    tier.spill(0, ROOT_HASH, h(n), tokens(n))
    assert tier.flush(10)


def restore(tier: DiskTier, host: HostTier, pages: list[int]) -> DiskRestores:
    """Restore pages for one request, waiting until the restore ends."""
    restores = DiskRestores(tier, host, BlockPool(1, page_size=PAGE))
    assert restores.start("r", [], [], [(ROOT_HASH, h(n), tokens(n)) for n in pages])
    while restores.restoring("r"):
        restores.wait(1.0)
        restores.poll()
    return restores


def read(tier: DiskTier, host: HostTier, n: int) -> bytes | None:
    restores = restore(tier, host, [n])
    slot = host.find(h(n), tokens(n))
    read = restores.read_pages("r") == {h(n)}
    restores.finish("r")
    host.check_invariants()
    return bytes(tier.memory.slot_view(slot)) if read and slot is not None else None


def test_a_page_file_reads_back_only_as_written(tmp_path: Path) -> None:
    payload = bytes(range(PAGE_BYTES))
    path = tmp_path / "page"
    path.write_bytes(page_header(FORMAT, h(1), [5, 6], payload) + payload)
    into = memoryview(bytearray(PAGE_BYTES))
    assert read_page(path, FORMAT, h(1), [5, 6], into) is PageRead.OK and into == payload
    assert read_page(path, b"G" * 16, h(1), [5, 6], into) is PageRead.CORRUPT  # other format
    assert read_page(path, FORMAT, h(2), [5, 6], into) is PageRead.CORRUPT  # other page
    assert read_page(path, FORMAT, h(1), [5, 7], into) is PageRead.CORRUPT  # other tokens
    assert read_page(tmp_path / "gone", FORMAT, h(1), [5, 6], into) is PageRead.MISSING
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])
    assert read_page(path, FORMAT, h(1), [5, 6], into) is PageRead.CORRUPT  # truncated
    path.write_bytes(whole + b"x")
    assert read_page(path, FORMAT, h(1), [5, 6], into) is PageRead.CORRUPT  # too long
    path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 0x80]))
    assert read_page(path, FORMAT, h(1), [5, 6], into) is PageRead.CORRUPT  # a flipped bit
    # A flipped bit anywhere in the payload, and a whole zeroed stretch (a torn write).
    for at in (len(whole) - PAGE_BYTES, len(whole) - PAGE_BYTES // 2):
        path.write_bytes(whole[:at] + bytes([whole[at] ^ 0x01]) + whole[at + 1:])
        assert read_page(path, FORMAT, h(1), [5, 6], into) is PageRead.CORRUPT
    torn = len(whole) - PAGE_BYTES // 3
    path.write_bytes(whole[:torn] + bytes(PAGE_BYTES // 3))
    assert read_page(path, FORMAT, h(1), [5, 6], into) is PageRead.CORRUPT
    # A file of the first format version (BLAKE2b checksums) is not read.
    path.write_bytes(whole[:8] + (1).to_bytes(2, "little") + whole[10:])
    assert read_page(path, FORMAT, h(1), [5, 6], into) is PageRead.CORRUPT


def test_the_budget_evicts_the_least_recently_used_file(tmp_path: Path) -> None:
    slots = Slots(4)
    tier = make_tier(tmp_path, 3, slots)
    host = HostTier(4, page_size=PAGE, page_bytes=PAGE_BYTES)
    for n in (1, 2, 3):
        spill(tier, slots, n)
    assert tier.cached_hashes() == [h(1), h(2), h(3)]
    assert read(tier, host, 1) == bytes([1]) * PAGE_BYTES  # page 1 is now the newest
    spill(tier, slots, 4)
    assert tier.cached_hashes() == [h(3), h(1), h(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(h(n).hex() for n in (1, 3, 4))
    assert tier.counters.evicted_pages == 1 and tier.counters.written_pages == 4
    assert tier.cached_bytes <= tier.budget_bytes
    spill(tier, slots, 4)  # held already: not written again
    assert tier.counters.written_pages == 4
    tier.close()


def test_a_restart_finds_the_files_in_their_lru_order(tmp_path: Path) -> None:
    slots = Slots(4)
    tier = make_tier(tmp_path, 4, slots)
    for n in (1, 2, 3, 4):
        spill(tier, slots, n)
    tier.close()
    now = time.time()
    for age, n in ((30, 3), (20, 1), (10, 4), (5, 2)):
        os.utime(tmp_path / h(n).hex(), (now - age, now - age))
    stale, fresh = tmp_path / f"{h(9).hex()}.123.tmp", tmp_path / f"{h(8).hex()}.456.tmp"
    stale.write_bytes(b"cut short")
    os.utime(stale, (now - 120, now - 120))
    fresh.write_bytes(b"being written by another engine")
    (tmp_path / "notes.txt").write_text("not ours")
    again = make_tier(tmp_path, 3, Slots(4))  # a smaller budget now
    assert again.cached_hashes() == [h(1), h(4), h(2)]  # the oldest, page 3, evicted
    assert not (tmp_path / h(3).hex()).exists()
    assert not stale.exists() and fresh.exists()
    assert (tmp_path / "notes.txt").exists()
    host = HostTier(4, page_size=PAGE, page_bytes=PAGE_BYTES)
    assert read(again, host, 4) == bytes([4]) * PAGE_BYTES
    again.close()


def test_a_restore_past_its_deadline_reads_nothing(tmp_path: Path) -> None:
    slots = Slots(4)
    tier = make_tier(tmp_path, 4, slots, restore_seconds=0.0)
    spill(tier, slots, 1)
    host = HostTier(4, page_size=PAGE, page_bytes=PAGE_BYTES)
    restores = restore(tier, host, [1])
    assert restores.read_pages("r") == set()
    assert tier.counters.deadline_hits == 1 and tier.counters.bytes_read == 0
    restores.finish("r")
    restores.wait(1.0)  # the readers skip the page and hand its slot back
    restores.poll()
    assert host.num_cached == host.num_reserved == 0
    restores.check_invariants()
    host.check_invariants()
    tier.close()


def test_a_budget_below_one_page_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not even one page file"):
        DiskTier(tmp_path, kv_format=FORMAT, page_size=PAGE, page_bytes=PAGE_BYTES,
                 budget_bytes=PAGE_BYTES, restore_seconds=1.0, memory=Slots(1))


def test_a_host_page_whose_copy_is_still_queued_is_not_offered_to_the_disk() -> None:
    """Its bytes are not in the slot yet; the copy into the slot is cancelled."""
    tier = HostTier(1, page_size=PAGE, page_bytes=PAGE_BYTES)
    offered: list[bytes] = []
    tier.on_evict = lambda slot, parent, page_hash, toks: offered.append(page_hash)
    tier.offload(page=0, parent=ROOT_HASH, page_hash=h(0), tokens=tokens(0))
    tier.offload(page=1, parent=ROOT_HASH, page_hash=h(1), tokens=tokens(1))  # same step: evicts page 0
    assert offered == [] and tier.take_transfers().stores == [(1, 0)]
    tier.offload(page=2, parent=ROOT_HASH, page_hash=h(2), tokens=tokens(2))  # the next step
    assert offered == [h(1)]


def _chain_hashes(kv: KVManager, token_ids: list[int]) -> list[bytes]:
    parent, hashes = ROOT_HASH, []
    for index in range(len(token_ids) // PAGE):
        parent = hash_page(parent, token_ids[index * PAGE : (index + 1) * PAGE], kv.fingerprint)
        hashes.append(parent)
    return hashes


def _computed(kv: KVManager, seq: Sequence, num_tokens: int) -> None:
    """seq admitted and its first num_tokens computed, then ended."""
    assert kv.try_admit(seq)
    seq.num_computed_tokens = num_tokens
    kv.commit(seq)
    kv.free(seq)


def test_a_waiting_request_reads_nothing_and_each_admission_counts_a_page_in_one_tier(
        tmp_path: Path) -> None:
    """A prompt whose pages are spread over the device, the host tier and the
    disk: while the pool has no room for it, admission reads no disk page
    and moves no host page; once admitted, it reads the disk page once and
    each tier's hit tokens add up to the tokens served from the cache (the
    disk page, copied on through a host slot, is the disk's alone)."""
    slots = Slots(3)
    host = HostTier(3, page_size=PAGE, page_bytes=PAGE_BYTES)
    disk = make_tier(tmp_path, 8, slots)
    pool = BlockPool(5, page_size=PAGE)
    kv = KVManager(pool, b"f" * 16, output_window=0, max_context=32, host=host, disk=disk)
    conversation = list(range(1, 10))  # four full pages before its last token
    _computed(kv, Sequence("first", conversation, SamplingParams(max_tokens=1)), 8)
    # The conversation's chain went to disk before (a run before, say): a
    # page is written only after its parent, so the disk holds it whole.
    parent = ROOT_HASH
    for index, page_hash in enumerate(_chain_hashes(kv, conversation[:8])):
        disk.spill(0, parent, page_hash, tuple(conversation[index * PAGE : (index + 1) * PAGE]))
        parent = page_hash
    # A prompt sharing the first page leaves its own page more recently used
    # than the conversation's second to fourth; evicting four pages leaves
    # page 1 on the device, pages 2 and 3 in the host tier, page 4 on disk
    # only.
    _computed(kv, Sequence("x", [1, 2, 60, 61, 62], SamplingParams(max_tokens=1)), 4)
    host.take_transfers()
    _computed(kv, Sequence("y", list(range(70, 77)), SamplingParams(max_tokens=1)), 0)
    host.take_transfers()
    assert disk.flush(10)
    p1, p2, p3, p4 = _chain_hashes(kv, conversation[:8])
    assert pool.lookup(p1, conversation[:2]) is not None
    assert host.find(p2, conversation[2:4]) is not None
    assert host.find(p3, conversation[4:6]) is not None
    assert disk.find(p4) and host.find(p4, conversation[6:8]) is None

    blocker = Sequence("blocker", [80, 81, 82], SamplingParams(max_tokens=1))
    assert kv.try_admit(blocker)
    host.take_transfers()
    evicted = host.counters.evicted_pages
    again = Sequence("again", conversation, SamplingParams(max_tokens=1))
    for _ in range(3):
        assert not kv.try_admit(again)
        host.take_transfers()
    assert disk.counters.bytes_read == 0 and host.counters.evicted_pages == evicted
    assert disk.counters.hit_pages == host.counters.hit_pages == 0
    kv.check_invariants([blocker])

    kv.free(blocker)
    assert not kv.try_admit(again) and kv.is_restoring(again)  # it fits: the reads begin
    while kv.is_restoring(again):
        kv.wait_for_reads(1.0)
        kv.poll_restores()
    assert kv.try_admit(again)
    assert disk.counters.bytes_read == disk.file_bytes  # the one disk page, once
    assert again.cache_hits == CacheHits(device=2, host=4, disk=2)
    served = again.num_computed_tokens
    hits = again.cache_hits
    assert hits.device + hits.host + hits.disk + hits.partial == served == 8
    assert (host.counters.hit_pages, host.counters.hit_tokens) == (2, 4)
    assert (disk.counters.hit_pages, disk.counters.hit_tokens) == (1, 2)
    assert kv.partial.hit_tokens == 0
    assert len(host.take_transfers().loads) == 3  # host and disk pages to the device
    kv.check_invariants([again])
    disk.close()


def test_reserved_slots_belong_to_no_page_and_held_pages_are_not_evicted() -> None:
    host = HostTier(3, page_size=PAGE, page_bytes=PAGE_BYTES)
    evicted: list[bytes] = []
    host.on_evict = lambda slot, parent, page_hash, toks: evicted.append(page_hash)
    for n in (1, 2, 3):
        host.store(ROOT_HASH, h(n), tokens(n))
    host.take_transfers()
    host.hold(h(1))  # the least recently used, kept for a waiting request
    reserved = host.reserve()
    assert reserved is not None and evicted == [h(2)]  # not page 1
    assert host.find(h(9), tokens(9)) is None and host.num_reserved == 1
    host.check_invariants()
    assert host.fill(reserved, ROOT_HASH, h(9), tokens(9)) == reserved
    assert host.find(h(9), tokens(9)) == reserved and host.num_reserved == 0
    # A page the device evicted to the tier while it was read: the read's
    # slot is freed and the page's own slot serves.
    other = host.reserve()
    assert other is not None
    assert host.fill(other, ROOT_HASH, h(9), tokens(9)) == reserved
    host.hold(h(9))
    host.hold(h(3))
    assert host.reserve() is not None  # a free slot (the one fill gave back)
    assert host.reserve() is None  # every page held
    host.release(h(1))
    assert host.reserve() is not None and evicted[-1] == h(1)
    host.check_invariants()


def test_a_read_that_fails_frees_its_slot_and_ends_the_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slots = Slots(4)
    tier = make_tier(tmp_path, 4, slots)
    for n in (1, 2):
        spill(tier, slots, n)

    def failing(path: Path, *args: object) -> PageRead:
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(disk_reader, "read_page", failing)
    host = HostTier(4, page_size=PAGE, page_bytes=PAGE_BYTES)
    restores = restore(tier, host, [1, 2])
    assert restores.read_pages("r") == set()
    restores.finish("r")
    for _ in range(10):  # the second read may come back after the first ended it
        if not host.num_reserved:
            break
        restores.wait(1.0)
        restores.poll()
    assert host.num_reserved == host.num_cached == 0
    assert tier.counters.deadline_hits == tier.counters.bytes_read == 0
    assert h(1) not in tier.cached_hashes()  # forgotten: its tokens are computed
    restores.check_invariants()
    tier.close()


def test_a_page_still_waiting_for_the_writer_is_found_and_read_from_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    released = threading.Event()
    write = DiskTier._write

    def slow_write(self: DiskTier, *args: object) -> None:
        assert released.wait(30)
        write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    slots = Slots(4)
    tier = make_tier(tmp_path, 4, slots)
    slots.memory[0][:] = bytes([7]) * PAGE_BYTES
    tier.spill(0, ROOT_HASH, h(7), tokens(7))
    slots.memory[0][:] = bytes(PAGE_BYTES)  # the slot reused at once
    assert tier.find(h(7)) and not (tmp_path / h(7).hex()).exists()
    host = HostTier(4, page_size=PAGE, page_bytes=PAGE_BYTES)
    assert read(tier, host, 7) == bytes([7]) * PAGE_BYTES
    assert tier.counters.bytes_read == 0  # nothing came from the disk
    released.set()
    assert tier.flush(10) and (tmp_path / h(7).hex()).exists()
    tier.close()


def test_pages_are_written_in_parallel_and_flush_waits_for_every_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert WRITER_THREADS > 1
    inside = threading.Barrier(WRITER_THREADS, timeout=10)
    released, first_done = threading.Event(), threading.Event()
    write = DiskTier._write

    def gated_write(self: DiskTier, *args: object) -> None:
        arrival = inside.wait()  # every writer is inside a write at once
        if arrival:
            assert released.wait(30)
        write(self, *args)  # type: ignore[arg-type]
        if not arrival:
            first_done.set()

    monkeypatch.setattr(DiskTier, "_write", gated_write)
    slots = Slots(WRITER_THREADS)
    tier = make_tier(tmp_path, WRITER_THREADS, slots)
    for n in range(WRITER_THREADS):
        slots.memory[n][:] = bytes([n]) * PAGE_BYTES
        tier.spill(n, ROOT_HASH, h(n), tokens(n))
    assert first_done.wait(10)
    assert not tier.flush(0.3)  # the others are still writing
    released.set()
    assert tier.flush(10)
    assert tier.counters.written_pages == WRITER_THREADS and tier.counters.dropped_pages == 0
    host = HostTier(WRITER_THREADS, page_size=PAGE, page_bytes=PAGE_BYTES)
    for n in range(WRITER_THREADS):
        assert read(tier, host, n) == bytes([n]) * PAGE_BYTES
    tier.close()


def test_shutdown_with_a_full_queue_writes_in_parallel_within_its_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pages, seconds, write_seconds = 80, 1.0, 0.1
    write = DiskTier._write

    def slow_write(self: DiskTier, *args: object) -> None:
        time.sleep(write_seconds)
        write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    monkeypatch.setattr("engine.kv.disk_tier.WRITE_QUEUE_BYTES", pages * PAGE_BYTES)
    slots = Slots(1)
    tier = make_tier(tmp_path, pages + 1, slots)
    for n in range(pages + 1):
        slots.memory[0][:] = bytes([n]) * PAGE_BYTES
        tier.spill(0, ROOT_HASH, h(n), tokens(n))
    assert tier.counters.dropped_pages == 1  # the queue was full
    started = time.monotonic()
    tier.persist(HostTier(1, page_size=PAGE, page_bytes=PAGE_BYTES), seconds)
    # The bound, plus the writes under way when it passed.
    assert time.monotonic() - started < seconds + 2 * write_seconds + 0.3
    written = tier.counters.written_pages
    # One writer would manage seconds / write_seconds pages.
    assert 2 * seconds / write_seconds < written < pages
    assert len([p for p in tmp_path.iterdir() if not p.name.endswith(".tmp")]) == written
    assert sum(tier.find(h(n)) for n in range(pages + 1)) == written  # the rest forgotten
