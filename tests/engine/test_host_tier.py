"""The host tier's bookkeeping (engine/kv/host_tier.py) and its sizing
(engine/kv/kv_sizing.py plan_host_kv): pure Python, no model."""

from __future__ import annotations

import pytest

from engine.kv.block_hash import ROOT_HASH
from engine.kv.block_pool import BlockPool
from engine.kv.host_tier import HostTier
from engine.kv.kv_manager import KVManager
from engine.kv.kv_sizing import HOST_KV_AUTO, plan_host_kv
from engine.scheduling.sequence import Sequence
from protocol import SamplingParams

GIB = 2**30
MIB = 2**20


def h(n: int) -> bytes:
    return n.to_bytes(16, "big")


def test_lookups_confirm_tokens_and_a_full_tier_evicts_the_least_recently_used() -> None:
    tier = HostTier(3, page_size=2, page_bytes=100)
    for n in range(3):
        tier.offload(page=n, parent=ROOT_HASH, page_hash=h(n), tokens=[n, n])
    assert tier.find(h(1), [1, 1]) is not None
    assert tier.find(h(1), [1, 2]) is None  # same hash, other tokens: a miss
    tier.take_transfers()
    # A hit makes page 0 the most recently used; page 1 is now the oldest.
    tier.load(tier.find(h(0), [0, 0]), page=7)  # type: ignore[arg-type]
    tier.take_transfers()
    tier.offload(page=3, parent=ROOT_HASH, page_hash=h(3), tokens=[3, 3])
    assert tier.cached_hashes() == [h(2), h(0), h(3)]
    assert tier.counters.evicted_pages == 1 and tier.counters.stored_pages == 4
    assert tier.counters.bytes_to_host == 400 and tier.counters.bytes_to_device == 100
    tier.check_invariants()


def test_a_hash_already_held_is_not_stored_again_but_refreshed() -> None:
    tier = HostTier(2, page_size=2, page_bytes=100)
    tier.offload(0, ROOT_HASH, h(0), [0, 0])
    tier.offload(1, ROOT_HASH, h(1), [1, 1])
    transfers = tier.take_transfers()
    assert [page for page, _ in transfers.stores] == [0, 1]
    tier.offload(5, ROOT_HASH, h(0), [0, 0])  # evicted from the device again
    assert not tier.take_transfers()
    assert tier.counters.stored_pages == 2
    assert tier.cached_hashes() == [h(1), h(0)]


def test_slots_being_read_are_not_reused_until_the_copies_are_taken() -> None:
    tier = HostTier(1, page_size=2, page_bytes=100)
    tier.offload(0, ROOT_HASH, h(0), [0, 0])
    tier.take_transfers()
    slot = tier.find(h(0), [0, 0])
    assert slot is not None
    tier.load(slot, page=4)
    tier.offload(1, ROOT_HASH, h(1), [1, 1])  # nowhere to go this step: dropped
    transfers = tier.take_transfers()
    assert transfers.loads == [(slot, 4)] and transfers.stores == []
    assert tier.cached_hashes() == [h(0)]
    tier.offload(1, ROOT_HASH, h(1), [1, 1])  # the next step may reuse the slot
    assert tier.take_transfers().stores == [(1, slot)]
    assert tier.cached_hashes() == [h(1)]


def test_admission_restores_host_pages_and_registers_them_on_the_device() -> None:
    pool = BlockPool(4, page_size=2)
    tier = HostTier(8, page_size=2, page_bytes=10)
    kv = KVManager(pool, b"f" * 16, output_window=0, max_context=16, host=tier)
    first = Sequence("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=1))
    assert kv.try_admit(first)
    first.num_computed_tokens = 7
    kv.commit(first)
    kv.free(first)
    # Another prompt takes every device page: the three cached ones go to the host.
    other = Sequence("b", [9] * 8, SamplingParams(max_tokens=1))
    assert kv.try_admit(other)
    assert len(tier.take_transfers().stores) == 3
    kv.free(other)
    again = Sequence("c", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=1))
    assert kv.try_admit(again)
    assert again.num_computed_tokens == 6
    loads = tier.take_transfers().loads
    assert [page for _, page in loads] == again.block_table[:3]
    assert all(pool.lookup(page_hash, again.token_ids[2 * i : 2 * i + 2]) == again.block_table[i]
               for i, page_hash in enumerate(again.block_hashes))
    assert tier.counters.hit_pages == 3 and tier.counters.hit_tokens == 6
    kv.check_invariants([again])


def test_a_lookup_that_stops_at_an_unknown_page_is_a_miss() -> None:
    pool = BlockPool(4, page_size=2)
    tier = HostTier(4, page_size=2, page_bytes=10)
    kv = KVManager(pool, b"f" * 16, output_window=0, max_context=16, host=tier)
    assert kv.try_admit(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=1)))
    assert tier.counters.misses == 1
    # One token: no full page to look up, so no miss.
    assert kv.try_admit(Sequence("b", [1], SamplingParams(max_tokens=1)))
    assert tier.counters.misses == 1


@pytest.mark.parametrize(("asked", "available", "total", "slots", "capped"), [
    (0, 20 * GIB, 24 * GIB, 0, False),  # off
    (64, 20 * GIB, 24 * GIB, 64, False),  # 64 MiB of 1 MiB pages
    # auto: available less max(25% of 24 GiB, 4 GiB) = 20 - 6 GiB.
    (HOST_KV_AUTO, 20 * GIB, 24 * GIB, 14 * 1024, False),
    # On a small machine the 4 GiB floor is the reserve.
    (HOST_KV_AUTO, 6 * GIB, 8 * GIB, 2 * 1024, False),
    # Asking for more than may be taken gets what may be taken.
    (64 * 1024, 20 * GIB, 24 * GIB, 14 * 1024, True),
    (HOST_KV_AUTO, 3 * GIB, 8 * GIB, 0, False),  # nothing left above the reserve
])
def test_host_tier_sizing(asked: int, available: int, total: int, slots: int,
                          capped: bool) -> None:
    plan = plan_host_kv(asked, MIB, available, total)
    assert (plan.num_slots, plan.capped) == (slots, capped)
    assert plan.total_bytes == slots * MIB
