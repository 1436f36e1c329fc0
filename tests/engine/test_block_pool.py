from __future__ import annotations

import pytest

from engine.kv.block_hash import ROOT_HASH, hash_page, kv_fingerprint
from engine.kv.block_pool import BlockPool, PoolExhausted

FP = kv_fingerprint("model", "float32", 4)


def test_allocate_release_and_counts() -> None:
    pool = BlockPool(4, 4)
    pages = pool.allocate(3)
    assert len(set(pages)) == 3 and pool.num_free == 1 and pool.num_used == 3
    pool.check_invariants()
    pool.release(pages)
    assert pool.num_free == 4
    pool.check_invariants()
    with pytest.raises(PoolExhausted):
        pool.allocate(5)


def test_cached_page_is_reused_only_for_the_same_tokens() -> None:
    pool = BlockPool(4, 4)
    (page,) = pool.allocate(1)
    tokens = [1, 2, 3, 4]
    page_hash = hash_page(ROOT_HASH, tokens, FP)
    pool.register(page, ROOT_HASH, page_hash, tokens)
    pool.release([page])
    assert pool.num_cached == 1 and pool.num_free == 4
    assert pool.lookup(page_hash, tokens) == page
    # A colliding hash with other tokens is not a hit.
    assert pool.lookup(page_hash, [1, 2, 3, 5]) is None
    pool.acquire([page])
    assert pool.num_cached == 0 and pool.num_free == 3
    pool.check_invariants()


def test_eviction_takes_free_pages_first_then_least_recently_cached() -> None:
    pool = BlockPool(3, 2)
    pages = pool.allocate(3)
    hashes = []
    for i, page in enumerate(pages):
        tokens = [i, i]
        hashes.append(hash_page(ROOT_HASH, tokens, FP))
        pool.register(page, ROOT_HASH, hashes[-1], tokens)
    pool.release([pages[1]])
    pool.release([pages[0]])
    pool.release([pages[2]])
    # LRU order is 1, 0, 2: the first allocation evicts page 1 and forgets its hash.
    (first,) = pool.allocate(1)
    assert first == pages[1]
    assert pool.lookup(hashes[1], [1, 1]) is None
    assert pool.lookup(hashes[0], [0, 0]) == pages[0]
    pool.check_invariants()


def test_duplicate_content_keeps_the_first_copy() -> None:
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    h = hash_page(ROOT_HASH, [7, 7], FP)
    pool.register(a, ROOT_HASH, h, [7, 7])
    pool.register(b, ROOT_HASH, h, [7, 7])
    pool.release([a, b])
    assert pool.num_cached == 1  # b went back to the free list
    pool.check_invariants()


def test_double_release_is_caught() -> None:
    pool = BlockPool(2, 2)
    (page,) = pool.allocate(1)
    pool.release([page])
    with pytest.raises(AssertionError):
        pool.release([page])


def test_hash_chain_depends_on_parent_and_fingerprint() -> None:
    a = hash_page(ROOT_HASH, [1, 2], FP)
    assert hash_page(a, [3, 4], FP) != hash_page(ROOT_HASH, [3, 4], FP)
    assert hash_page(ROOT_HASH, [1, 2], kv_fingerprint("other")) != a
    assert len(a) == 16
