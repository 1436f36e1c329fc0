"""Long-lived objects are hidden from full collections (router/heap.py)."""

from __future__ import annotations

import gc

from router.heap import freeze_long_lived


def test_freezing_hides_what_exists_from_later_collections() -> None:
    gc.unfreeze()
    kept = [[i] for i in range(10_000)]
    try:
        freeze_long_lived(collect_first=True)
        assert gc.get_freeze_count() >= len(kept)
        # The collector's generations (what a full collection walks) no longer hold them.
        walked = {id(obj) for generation in range(3) for obj in gc.get_objects(generation)}
        assert not any(id(x) in walked for x in kept)
        fresh = [1]
        assert id(fresh) in {id(obj) for obj in gc.get_objects(0)}
    finally:
        gc.unfreeze()
