"""The disk tier admits whole chains (engine/kv/disk_tier.py spill): a page is
written only after its parent, so every file a restart finds is reachable by
a lookup; and the tiers above let chains leave head first (BlockPool.allocate,
HostTier._parent_first). Pure Python: host slots are plain bytearrays."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine.kv import disk_tier as disk_tier_module
from engine.kv.block_hash import ROOT_HASH, hash_page, parents_first
from engine.kv.block_pool import BlockPool
from engine.kv.disk_tier import DiskTier
from engine.kv.host_tier import HostTier
from engine.kv.kv_manager import KVManager
from engine.scheduling.sequence import Sequence
from protocol import EngineStats, SamplingParams
from tests.engine.test_disk_tier import PAGE, PAGE_BYTES, Slots, h, make_tier, tokens

# A page offered to the disk: its parent, its hash, whether the disk held it
# already, whether it was queued for writing.
Offer = tuple[bytes, bytes, bool, bool]


def gate_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Writers wait for the event before each write."""
    released = threading.Event()
    write = DiskTier._write

    def gated(self: DiskTier, *args: object) -> None:
        assert released.wait(30)
        write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "_write", gated)
    return released


def test_a_page_whose_parent_is_not_on_disk_is_not_written(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, 8, Slots(1))
    tier.spill(0, h(1), h(2), tokens(2))  # page 1 was never offered
    assert tier.flush(10)
    assert not tier.find(h(2)) and list(tmp_path.iterdir()) == []
    assert tier.counters.orphan_pages == 1 and tier.counters.written_pages == 0
    tier.spill(0, ROOT_HASH, h(1), tokens(1))
    tier.spill(0, h(1), h(2), tokens(2))  # its parent queued (or written): admitted
    assert tier.flush(10)
    assert set(tier.cached_hashes()) == {h(1), h(2)} and tier.counters.written_pages == 2
    stats = EngineStats()
    tier.report(stats)
    assert stats.disk_kv_orphan_pages_total == 1
    tier.close()


def test_a_chain_whose_head_finds_the_queue_full_is_dropped_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_tier_module, "WRITE_QUEUE_BYTES", PAGE_BYTES)
    released = gate_writes(monkeypatch)
    tier = make_tier(tmp_path, 8, Slots(1))
    offers = [(ROOT_HASH, h(1)), (ROOT_HASH, h(11))]  # chain 1's head, then chain 11's
    for parent, page_hash in offers:
        tier.spill(0, parent, page_hash, tokens(0))
    assert tier.counters.dropped_pages == 1  # page 11: the queue holds page 1
    released.set()
    assert tier.flush(10)
    later = [(h(11), h(12)), (h(12), h(13)), (h(1), h(2)), (ROOT_HASH, h(1))]
    for parent, page_hash in later:
        tier.spill(0, parent, page_hash, tokens(0))
    assert tier.flush(10)
    assert tier.cached_hashes() == [h(1), h(2)]  # chain 11 left no fragment
    counters = tier.counters
    assert (counters.written_pages, counters.dropped_pages, counters.orphan_pages) == (2, 1, 2)
    present = 1  # page 1, offered again
    assert len(offers) + len(later) == (counters.written_pages + counters.dropped_pages
                                        + counters.orphan_pages + present)
    tier.close()


def test_a_page_whose_parent_fails_to_write_meanwhile_is_an_orphan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admitted while its parent waited for the writer, which then failed."""
    monkeypatch.setattr(disk_tier_module, "WRITER_THREADS", 1)  # one write at a time, in order
    released = gate_writes(monkeypatch)

    def failing(path: Path, mode: str = "r", *args: object, **kwargs: object) -> object:
        if Path(path).name.startswith(h(1).hex()):
            raise OSError(5, "Input/output error", str(path))
        return open(path, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(disk_tier_module, "open", failing, raising=False)
    tier = make_tier(tmp_path, 8, Slots(1))
    tier.spill(0, ROOT_HASH, h(1), tokens(1))
    tier.spill(0, h(1), h(2), tokens(2))
    released.set()
    assert tier.flush(10)
    assert tier.num_cached == 0 and list(tmp_path.iterdir()) == []
    assert (tier.counters.dropped_pages, tier.counters.orphan_pages) == (1, 1)
    tier.close()


def test_shutdown_writes_resident_pages_parents_first_and_only_whole_chains(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[bytes] = []
    write = DiskTier._write

    def recorded(self: DiskTier, parent: bytes, page_hash: bytes, *args: object) -> None:
        written.append(page_hash)
        write(self, parent, page_hash, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "_write", recorded)
    tier = make_tier(tmp_path, 8, Slots(4))
    tier.spill(0, ROOT_HASH, h(5), tokens(5))
    assert tier.flush(10)
    host = HostTier(4, page_size=PAGE, page_bytes=PAGE_BYTES)
    # Least recently used first: the chain's head, then its tail, then a page
    # after one no tier holds, then a page after one on disk already.
    for parent, page_hash in ((ROOT_HASH, h(1)), (h(1), h(2)), (h(8), h(9)), (h(5), h(6))):
        host.store(parent, page_hash, tokens(0))
    host.take_transfers()
    tier.persist(host)
    # Most recently used first, each after its parent.
    assert written == [h(5), h(6), h(1), h(2)]
    assert set(tier.cached_hashes()) == {h(5), h(6), h(1), h(2)}
    assert tier.counters.orphan_pages == 1


def test_parents_first_puts_each_page_after_its_parent() -> None:
    links = [(h(3), h(4)), (h(9), h(10)), (h(2), h(3)), (ROOT_HASH, h(2)), (h(2), h(7))]
    assert [links[i][1] for i in parents_first(links)] == [h(2), h(3), h(4), h(10), h(7)]


# ---- the real eviction path: device pool -> host tier -> disk -----------------------------


def tiers(tmp_path: Path, pool_pages: int, host_slots: int
          ) -> tuple[KVManager, HostTier, DiskTier, list[Offer]]:
    """A KVManager over a small pool, host tier and disk; every page the host
    tier offers the disk is recorded."""
    host = HostTier(host_slots, page_size=PAGE, page_bytes=PAGE_BYTES)
    disk = make_tier(tmp_path, 64, Slots(host_slots))
    kv = KVManager(BlockPool(pool_pages, page_size=PAGE), b"f" * 16, output_window=0,
                   max_context=64, host=host, disk=disk)
    offers: list[Offer] = []
    spill = host.on_evict
    assert spill is not None

    def recording(slot: int, parent: bytes, page_hash: bytes, toks: tuple[int, ...]) -> None:
        held = disk.find(page_hash)
        refused = disk.counters.orphan_pages + disk.counters.dropped_pages
        spill(slot, parent, page_hash, toks)
        queued = not held and refused == disk.counters.orphan_pages + disk.counters.dropped_pages
        offers.append((parent, page_hash, held, queued))

    host.on_evict = recording
    return kv, host, disk, offers


def computed(kv: KVManager, request_id: str, token_ids: list[int]) -> None:
    """A request admitted, its prompt computed (but the last token), ended."""
    seq = Sequence(request_id, token_ids, SamplingParams(max_tokens=1))
    while not kv.try_admit(seq):  # its prefix goes on into the disk: read first
        assert kv.is_restoring(seq)
        while kv.is_restoring(seq):
            kv.wait_for_reads(1.0)
            kv.poll_restores()
    seq.num_computed_tokens = len(token_ids) - 1
    kv.commit(seq)
    kv.free(seq)
    kv.take_transfers()


def chain(kv: KVManager, token_ids: list[int]) -> list[bytes]:
    """The hashes of the full pages before token_ids' last token."""
    parent, hashes = ROOT_HASH, []
    for index in range((len(token_ids) - 1) // PAGE):
        parent = hash_page(parent, token_ids[index * PAGE : (index + 1) * PAGE], kv.fingerprint)
        hashes.append(parent)
    return hashes


def assert_written_after_parents(offers: list[Offer]) -> None:
    """Every page queued for writing was queued after its parent (the disk
    started empty)."""
    queued = {ROOT_HASH}
    for parent, page_hash, _, admitted in offers:
        if admitted:
            assert parent in queued, "a page queued before its parent"
            queued.add(page_hash)


def assert_counters_add_up(disk: DiskTier, offers: list[Offer]) -> None:
    counters = disk.counters
    present = sum(1 for _, _, held, _ in offers if held)
    assert len(offers) == (counters.written_pages + counters.dropped_pages
                           + counters.orphan_pages + present)


def test_a_request_evicted_tail_first_leaves_the_host_tier_head_first(
        tmp_path: Path) -> None:
    """The device frees a request's pages tail first, so they reach the host
    tier children first; it evicts them head first all the same, so the
    disk takes each one after its parent, and the whole chain."""
    kv, host, disk, offers = tiers(tmp_path, pool_pages=5, host_slots=4)
    conversation = list(range(1, 10))  # four full pages before its last token
    computed(kv, "first", conversation)
    computed(kv, "other", list(range(50, 59)))  # evicts the whole conversation at once
    assert host.cached_hashes() == chain(kv, conversation)[::-1]
    computed(kv, "more", list(range(60, 69)))  # pushes it on out of the host tier
    assert disk.flush(10)
    assert set(chain(kv, conversation)) <= set(disk.cached_hashes())
    assert_written_after_parents(offers)
    assert disk.counters.orphan_pages == 0
    assert_counters_add_up(disk, offers)
    disk.close()


def test_a_chain_evicted_tail_first_over_several_steps_leaves_the_host_tier_head_first(
        tmp_path: Path) -> None:
    """Two allocations evict a request's tail, then its head: the host tier
    holds the tail longest, evicting the head before it (to the disk), so the
    chain is written whole."""
    kv, host, disk, offers = tiers(tmp_path, pool_pages=5, host_slots=6)
    conversation = list(range(1, 10))
    first = chain(kv, conversation)
    computed(kv, "first", conversation)  # cached, tail first: partial, 4, 3, 2, 1
    computed(kv, "tail", [50, 51, 52, 53, 54])  # three pages: the partial, 4, 3
    assert set(host.cached_hashes()) == set(first[2:])
    computed(kv, "head", list(range(60, 69)))  # five pages: pages 2 and 1, its own
    computed(kv, "more", list(range(70, 79)))  # the host tier passes all on
    assert disk.flush(10)
    assert set(first) <= set(disk.cached_hashes())
    assert_written_after_parents(offers)
    assert_counters_add_up(disk, offers)
    disk.close()


def test_a_restart_finds_whole_prefixes_of_conversations_written_under_pressure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk slower than the evictions (a two-page queue, slow writes)
    drops most pages; what it wrote is whole prefixes, all of it reachable
    after a restart."""
    write = DiskTier._write

    def slow_write(self: DiskTier, *args: object) -> None:
        time.sleep(0.002)
        write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    monkeypatch.setattr(disk_tier_module, "WRITE_QUEUE_BYTES", 2 * PAGE_BYTES)
    kv, _, disk, offers = tiers(tmp_path, pool_pages=12, host_slots=6)
    conversations = [[1000 * c + t for t in range(1, 12)] for c in range(1, 9)]
    for turn in (7, 11):  # two turns each, the second extending the first
        for c, conversation in enumerate(conversations):
            computed(kv, f"c{c}-t{turn}", conversation[:turn])
            time.sleep(0.001)
    for n in range(5):  # push the last ones out too
        computed(kv, f"filler-{n}", [90000 + 100 * n + t for t in range(11)])
    assert disk.flush(10)
    assert disk.counters.dropped_pages > 0 and disk.counters.written_pages > 0
    assert_written_after_parents(offers)
    assert_counters_add_up(disk, offers)
    disk.close()

    again = make_tier(tmp_path, 64, Slots(6))
    on_disk = set(again.cached_hashes())
    restarted = KVManager(BlockPool(12, page_size=PAGE), b"f" * 16, output_window=0,
                          max_context=64, host=HostTier(6, page_size=PAGE, page_bytes=PAGE_BYTES),
                          disk=again)
    found = 0
    for conversation in conversations:
        hashes = chain(restarted, conversation)
        prefix, _ = restarted._cached_prefix(Sequence("probe", conversation, SamplingParams(max_tokens=1)))
        assert [page.page_hash for page in prefix] == hashes[: len(prefix)]
        # Whatever of the conversation is on disk is the prefix found.
        assert on_disk & set(hashes) == set(hashes[: len(prefix)])
        found += len(prefix)
    fillers = [[90000 + 100 * n + t for t in range(11)] for n in range(5)]
    found += sum(len(restarted._cached_prefix(Sequence("probe", f, SamplingParams(max_tokens=1)))[0])
                 for f in fillers)
    assert found == len(on_disk) > 0  # every file reachable
    again.close()


class FakeDisk:
    """A disk tier that takes every page after its parent, counting the
    host tier's questions."""

    def __init__(self) -> None:
        self.held: set[bytes] = {ROOT_HASH}
        self.questions = 0

    def has_room(self) -> bool:
        return True

    def continues(self, parent: bytes) -> bool:
        self.questions += 1
        return parent in self.held


def test_a_long_chain_leaves_the_host_tier_head_first_in_linear_time() -> None:
    length = 200
    host = HostTier(length, page_size=PAGE, page_bytes=PAGE_BYTES)
    disk = FakeDisk()
    evicted: list[bytes] = []

    def spill(slot: int, parent: bytes, page_hash: bytes, toks: tuple[int, ...]) -> None:
        assert parent in disk.held, "a page left before its parent"
        disk.held.add(page_hash)
        evicted.append(page_hash)

    host.on_evict, host.below = spill, disk
    links = [(ROOT_HASH if n == 1 else h(n - 1), h(n)) for n in range(1, length + 1)]
    for parent, page_hash in reversed(links):  # tail first, as the device frees them
        host.store(parent, page_hash, tokens(0))
    host.take_transfers()
    for n in range(length):
        host.store(ROOT_HASH, h(10_000 + n), tokens(0))
    assert evicted == [page_hash for _, page_hash in links]
    assert disk.questions <= 3 * length  # each page's ancestors are walked once
    host.check_invariants()
