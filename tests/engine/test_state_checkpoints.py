"""The bookkeeping of recurrent-state checkpoints (engine/kv/state_checkpoints.py):
keys to the token, the deepest match within the cached KV, least recently
used out. Pure Python: no model."""

from __future__ import annotations

from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.state_checkpoints import Place, StateCheckpoints

PAGE = 4
FINGERPRINT = b"test"


def chain(tokens: list[int]) -> list[bytes]:
    """The hashes of tokens' full pages, as the prefix cache computes them."""
    hashes, parent = [], ROOT_HASH
    for index in range(len(tokens) // PAGE):
        parent = hash_page(parent, tokens[index * PAGE : (index + 1) * PAGE], FINGERPRINT)
        hashes.append(parent)
    return hashes


def save(store: StateCheckpoints, tokens: list[int], length: int,
         committed: int = 0) -> int | None:
    """Save a checkpoint of tokens[:length]; `committed` full pages' hashes
    known. Returns its device index (no tier here moves one to the host)."""
    index, moved = store.save(store.key(tokens, length, chain(tokens)[:committed]))
    assert moved is None
    return index


def on_device(index: int | None) -> Place:
    assert index is not None
    return Place(False, index)


TOKENS = list(range(100, 130))


def test_keys_do_not_depend_on_how_far_the_chain_was_committed() -> None:
    store = StateCheckpoints(4, PAGE, FINGERPRINT)
    for committed in (0, 2, 5):
        assert store.key(TOKENS, 22, chain(TOKENS)[:committed]) == (chain(TOKENS)[4],
                                                                     tuple(TOKENS[20:22]))
    assert store.key(TOKENS, 3, []) == (ROOT_HASH, tuple(TOKENS[:3]))
    assert store.key(TOKENS, 8, chain(TOKENS)) == (chain(TOKENS)[1], ())


def test_find_takes_the_deepest_checkpoint_within_the_cached_tokens() -> None:
    store = StateCheckpoints(4, PAGE, FINGERPRINT)
    shallow, deep, deepest = save(store, TOKENS, 9), save(store, TOKENS, 18), save(store, TOKENS, 27)
    assert {shallow, deep, deepest} == {0, 1, 2}
    hashes = chain(TOKENS)
    assert store.find(TOKENS, hashes, 29) == (27, on_device(deepest))
    assert store.find(TOKENS, hashes, 26) == (18, on_device(deep))  # 27 is past the cached KV
    assert store.find(TOKENS, hashes[:4], 17) == (9, on_device(shallow))
    # Another continuation of the first 20 tokens: only checkpoints inside them match.
    other = [*TOKENS[:20], 7, 7, 7, 7, 7, 7, 7, 7]
    assert store.find(other, chain(other), 27) == (18, on_device(deep))
    assert store.find([1, 2, 3], [], 3) is None


def test_a_held_key_is_not_saved_twice_and_the_oldest_makes_room() -> None:
    store = StateCheckpoints(2, PAGE, FINGERPRINT)
    first = save(store, TOKENS, 5)
    assert save(store, TOKENS, 5, committed=1) is None  # held: no copy needed
    second = save(store, TOKENS, 10)
    store.find(TOKENS, chain(TOKENS), 6)  # the first is used again: the second is older
    third = save(store, TOKENS, 15)
    assert third == second and store.counters.evicted == 1
    hashes = chain(TOKENS)
    assert store.find(TOKENS, hashes, 12) == (5, on_device(first))
    assert store.find(TOKENS, hashes, 16) == (15, on_device(third))
    store.check_invariants()


def test_with_host_rows_the_checkpoint_making_room_moves_there() -> None:
    store = StateCheckpoints(1, PAGE, FINGERPRINT, host_count=1)
    hashes = chain(TOKENS)
    assert store.save(store.key(TOKENS, 5, [])) == (0, None)
    # The device's one checkpoint moves to the host's one row for the new one.
    assert store.save(store.key(TOKENS, 10, [])) == (0, (0, 0))
    assert store.find(TOKENS, hashes, 8) == (5, Place(True, 0))
    assert store.find(TOKENS, hashes, 12) == (10, Place(False, 0))
    # A third: the device's moves to the host, whose (length 5) is dropped.
    assert store.save(store.key(TOKENS, 15, [])) == (0, (0, 0))
    assert store.find(TOKENS, hashes, 8) is None
    assert store.find(TOKENS, hashes, 12) == (10, Place(True, 0))
    assert store.counters.moved_to_host == 2 and store.counters.evicted == 1
    store.check_invariants()


def test_no_checkpoints_means_nothing_is_saved_or_found() -> None:
    store = StateCheckpoints(0, PAGE, FINGERPRINT)
    assert save(store, TOKENS, 10) is None
    assert store.find(TOKENS, chain(TOKENS), 29) is None
    store.check_invariants()
