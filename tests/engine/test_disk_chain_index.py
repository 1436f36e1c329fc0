"""The disk tier evicts chains from their ends (engine/kv/disk_chains.py): a
page no lookup can reach (its parent gone) is never left holding disk, by
the byte budget, by a damaged page, or across a restart."""

from __future__ import annotations

import os
from pathlib import Path

from engine.kv.block_hash import ROOT_HASH
from engine.kv.disk_chains import ChainIndex, file_name, parse_file_name
from engine.kv.disk_tier import DiskTier
from tests.engine.test_disk_tier import PAGE_BYTES, Slots, h, make_tier, tokens


def chain(index: ChainIndex, first: int, count: int, parent: bytes = ROOT_HASH) -> None:
    """Pages first..first+count-1, each after the one before, head first (as written)."""
    for n in range(first, first + count):
        index.add(h(n), 10, parent)
        parent = h(n)


def reachable(index: ChainIndex, parents: dict[bytes, bytes]) -> bool:
    return all(parents[page] == ROOT_HASH or parents[page] in index for page in index)


def test_a_chain_written_head_first_is_evicted_from_its_end() -> None:
    index = ChainIndex()
    chain(index, 1, 5)
    chain(index, 11, 3)  # a newer chain
    parents = {h(1): ROOT_HASH, **{h(n): h(n - 1) for n in range(2, 6)},
               h(11): ROOT_HASH, h(12): h(11), h(13): h(12)}
    order = []
    while len(index):
        order.append(index.evict()[0])
        assert reachable(index, parents)
    assert order == [h(n) for n in (5, 4, 3, 2, 1, 13, 12, 11)]
    assert index.total_bytes == 0


def test_branches_go_before_their_shared_head_and_a_used_chain_stays() -> None:
    index = ChainIndex()
    chain(index, 1, 2)
    chain(index, 3, 2, parent=h(2))  # 1-2-3-4
    chain(index, 5, 1, parent=h(2))  # 1-2-5
    chain(index, 11, 2)  # 11-12
    for n in range(1, 6):  # the first tree read since (a hit reads a chain whole)
        index.touch(h(n))
    assert [index.evict()[0] for _ in range(2)] == [h(12), h(11)]
    evicted = {index.evict()[0] for _ in range(3)}
    assert evicted == {h(3), h(4), h(5)} and list(index) == [h(1), h(2)]


def test_names_carry_the_parent_and_fragments_are_found() -> None:
    assert file_name(h(2), h(1)) == f"{h(2).hex()}-{h(1).hex()}"
    assert file_name(h(1), ROOT_HASH) == h(1).hex() == file_name(h(1), None)
    assert parse_file_name(file_name(h(2), h(1))) == (h(2), h(1))
    assert parse_file_name(h(1).hex()) == (h(1), None)  # a head, or an older file
    for other in ("notes.txt", h(1).hex()[:-2], f"{h(1).hex()}-zz", f"{h(1).hex()}.7.tmp"):
        assert parse_file_name(other) is None
    index = ChainIndex()
    chain(index, 1, 2)
    chain(index, 4, 3, parent=h(3))  # h(3) is not held: 4-5-6 are fragments
    assert sorted(index.fragments()) == [h(4), h(5), h(6)]
    chain(index, 10, 3)
    assert index.remove_chain_from(h(11)) == [file_name(h(11), h(10)), file_name(h(12), h(11))]
    assert list(index) == [h(1), h(2), h(4), h(5), h(6), h(10)]


def spill_chain(tier: DiskTier, slots: Slots, first: int, count: int) -> None:
    parent = ROOT_HASH
    for n in range(first, first + count):
        slots.memory[0][:] = bytes([n]) * PAGE_BYTES
        tier.spill(0, parent, h(n), tokens(n))
        assert tier.flush(10)
        parent = h(n)


def test_the_budget_keeps_a_chains_start_on_disk_and_a_restart_finds_it(tmp_path: Path) -> None:
    slots = Slots(1)
    tier = make_tier(tmp_path, 4, slots)
    spill_chain(tier, slots, 1, 6)
    # Plain LRU would have kept pages 3-6, none of which a lookup reaches.
    assert tier.cached_hashes() == [h(1), h(2), h(3), h(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [file_name(h(1), ROOT_HASH)] + [file_name(h(n), h(n - 1)) for n in (2, 3, 4)])
    tier.close()
    # A restart: the parents come back from the names, and a chain whose
    # start was lost (a file removed by hand) is deleted at once.
    (tmp_path / file_name(h(2), h(1))).unlink()
    again = make_tier(tmp_path, 4, slots)
    assert again.cached_hashes() == [h(1)]
    assert [p.name for p in tmp_path.iterdir()] == [file_name(h(1), ROOT_HASH)]
    spill_chain(again, slots, 11, 4)  # the fifth file: the budget evicts page 1, the oldest
    assert again.cached_hashes() == [h(11), h(12), h(13), h(14)]
    assert all(parse_file_name(p.name)[1] in (None, *again.cached_hashes())  # type: ignore[index]
               for p in tmp_path.iterdir())
    again.close()


def test_a_scan_takes_one_page_under_two_names_with_the_same_time(tmp_path: Path) -> None:
    # An older version's file beside this one's, for the same page: the
    # scan must not compare their parents (None against bytes) to order them.
    slots = Slots(1)
    tier = make_tier(tmp_path, 4, slots)
    spill_chain(tier, slots, 1, 2)
    tier.close()
    newer = tmp_path / file_name(h(2), h(1))
    older = tmp_path / h(2).hex()
    older.write_bytes(newer.read_bytes())
    stamp = newer.stat().st_mtime_ns
    for path in (newer, older):
        os.utime(path, ns=(stamp, stamp))
    again = make_tier(tmp_path, 4, slots)
    assert again.cached_hashes() == [h(1), h(2)]
    again.close()
