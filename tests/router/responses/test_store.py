"""The response store: LRU by records and by bytes, conversation chains."""

from __future__ import annotations

import logging

import pytest

from router.responses.store import ChainBroken, MissingResponse, ResponseStore, stored


def record(response_id: str, text: str = "hi", previous: str | None = None):  # type: ignore[no-untyped-def]
    body = {"id": response_id, "output": [{"id": f"msg_{response_id}", "type": "message", "text": text}]}
    inputs = [{"id": f"in_{response_id}", "type": "message", "role": "user"}]
    return stored(body, inputs, previous)


def test_the_least_recently_used_record_goes_past_the_record_bound(caplog: pytest.LogCaptureFixture) -> None:
    store = ResponseStore(max_records=2, max_bytes=1 << 20)
    store.put(record("a"))
    store.put(record("b"))
    assert store.get("a") is not None  # a is now more recent than b
    with caplog.at_level(logging.INFO, logger="router.responses.store"):
        store.put(record("c"))
    assert "b" not in store and "a" in store and "c" in store
    assert "evicted b" in caplog.text


def test_records_go_until_the_bytes_fit() -> None:
    small = record("a", "x")
    store = ResponseStore(max_records=100, max_bytes=3 * small.size)
    for name in "abc":
        store.put(record(name, "x"))
    assert len(store) == 3 and store.bytes == 3 * small.size
    store.put(record("d", "x" * (small.size + 1)))  # needs two records' room
    assert "a" not in store and "b" not in store and {"c", "d"} <= {k for k in "abcd" if k in store}
    assert store.bytes <= store.max_bytes


def test_a_record_larger_than_the_store_is_not_kept() -> None:
    small = record("a", "")
    store = ResponseStore(max_records=10, max_bytes=2 * small.size)
    store.put(small)
    assert not store.put(record("big", "y" * 2 * small.size))
    assert "big" not in store and "a" in store


def test_delete_frees_its_bytes() -> None:
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    store.put(record("a"))
    assert store.delete("a") and not store.delete("a")
    assert store.bytes == 0 and len(store) == 0


def test_a_conversation_is_its_chain_oldest_first() -> None:
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    store.put(record("a"))
    store.put(record("b", previous="a"))
    items = [item["id"] for item in store.conversation("b")]
    assert items == ["in_a", "msg_a", "in_b", "msg_b"]


def test_continuing_a_conversation_keeps_its_records_recent() -> None:
    store = ResponseStore(max_records=3, max_bytes=1 << 20)
    store.put(record("a"))
    store.put(record("other"))
    store.put(record("b", previous="a"))
    store.conversation("b")  # touches b and a
    store.put(record("c", previous="b"))
    assert "other" not in store and "a" in store


def test_a_missing_ancestor_is_named() -> None:
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    store.put(record("b", previous="a"))
    with pytest.raises(MissingResponse) as missing:
        store.conversation("b")
    assert missing.value.response_id == "a"


def test_a_running_continuation_keeps_its_chain_from_eviction() -> None:
    store = ResponseStore(max_records=2, max_bytes=1 << 20)
    store.put(record("a"))
    store.put(record("b", previous="a"))
    with store.pinned("b") as pin:
        store.put(record("other"))  # would evict a, the least recently used
        assert "a" in store and "b" in store
        pin.check()
        store.put(record("c", previous="b"))  # the continuation's own record
        # The unpinned record went instead, though more recently used.
        assert all(name in store for name in "abc") and "other" not in store
    # Unpinned, the store is brought back within its bounds.
    assert len(store) == 2 and "c" in store


def test_deleting_a_record_of_a_running_continuation_breaks_it() -> None:
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    store.put(record("a"))
    store.put(record("b", previous="a"))
    with store.pinned("b") as pin:
        assert store.delete("a")  # a DELETE is honoured at once
        with pytest.raises(ChainBroken) as broken:
            pin.check()
    assert broken.value.param == "previous_response_id"
    assert broken.value.code == "previous_response_not_found"
    assert "'a'" in broken.value.message
    assert "a" not in store


def test_a_new_conversation_pins_nothing() -> None:
    store = ResponseStore(max_records=1, max_bytes=1 << 20)
    with store.pinned(None) as pin:
        store.put(record("a"))
        store.put(record("b"))
        pin.check()
    assert "a" not in store and "b" in store
