"""Restores judged slower than computing are skipped (CPU engine,
engine/kv/restore_cost.py): with the disk measured slow, a returning prefix
whose pages are on disk only is computed instead of read, gives the tokens
computed from scratch and counts a skipped restore; with the disk judged
faster it is still read back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import protocol as p
from engine.kv import disk_reader
from engine.kv.restore_cost import RestoreCost
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.test_disk_kv_tier import disk, make_engine, push_to_disk, small_host_tier
from tests.engine.test_host_kv_tier import PAGE, SMALL_POOL, page_hashes, prompt, run

pytestmark = pytest.mark.usefixtures("small_host_tier")
__all__ = ["small_host_tier"]  # the fixture, shared

CONVERSATION = prompt(1)
OTHER = prompt(2)
# Each page read takes this long: with four readers, a prompt's 6 pages
# take two rounds, 1 s, where the tiny model computes their 48 tokens in
# ~10 ms (0.6 s on a CPU that other processes keep busy).
SLOW_READ_SECONDS = 0.5


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, computed with no tier at all."""
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_POOL)
    return {"conversation": run(core, events, "c", CONVERSATION)[0],
            "other": run(core, events, "o", OTHER)[0]}


def both_on_disk(model: Path, directory: Path, **overrides: object
                 ) -> tuple[EngineCore, list[p.EngineEvent]]:
    """An engine that computed both prompts (its prefill rate measured) and
    holds their pages on disk only; no restore has run (reads unmeasured)."""
    core, events = make_engine(model, directory, **overrides)
    run(core, events, "first", CONVERSATION)
    run(core, events, "other-first", OTHER)
    push_to_disk(core, events, OTHER)
    push_to_disk(core, events, CONVERSATION)
    cost = core.scheduler.kv.restore_cost
    assert cost is not None and cost.prefill.measured and not cost.reads.measured
    return core, events


def slow_reads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Make every page read take SLOW_READ_SECONDS; the pages read, listed."""
    reads: list[bytes] = []
    real = disk_reader.read_page

    def read_page(path: Path, kv_format: bytes, page_hash: bytes, tokens: object,
                  into: memoryview) -> disk_reader.PageRead:
        reads.append(page_hash)
        time.sleep(SLOW_READ_SECONDS)
        return real(path, kv_format, page_hash, tokens, into)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_reader, "read_page", read_page)
    return reads


def test_a_prefix_on_a_disk_measured_slower_than_computing_is_computed(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[str, list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A deadline the slow reads fit in: the disk is measured slow, but
    # reading all it was asked to.
    core, events = both_on_disk(tiny_qwen3_dir, tmp_path, disk_kv_restore_ms=10_000)
    tier, cost = disk(core), core.scheduler.kv.restore_cost
    assert cost is not None
    reads = slow_reads(monkeypatch)
    # The first restore goes ahead, however slow the disk: it is how the
    # read rate gets measured.
    assert run(core, events, "other", OTHER) == (expected["other"], 6 * PAGE)
    assert tier.counters.hit_pages == 6 and tier.counters.skipped == 0
    assert sorted(reads) == sorted(page_hashes(core, OTHER))
    assert cost.reads.measured
    assert cost.restore_seconds(6 * tier.file_bytes) > cost.compute_seconds(6 * PAGE)
    hits, misses, read = (tier.counters.hit_pages, tier.counters.misses,
                          tier.counters.bytes_read)

    events.clear()
    got, cached = run(core, events, "again", CONVERSATION)
    assert got == expected["conversation"]
    assert cached == 0  # every page was on disk only: all computed
    assert not set(reads) & set(page_hashes(core, CONVERSATION))  # not one read
    counters = tier.counters
    assert counters.skipped == 1 and counters.deadline_hits == 0
    assert counters.hit_pages == hits and counters.misses == misses + 1
    assert counters.bytes_read == read
    assert [o.cache_hits for o in in_process.step_outputs(events) if o.cache_hits] == [
        p.CacheHits()]
    assert core._stats.disk_kv_skipped_total == 1
    # Its pages stay on disk (skipped, not forgotten).
    assert set(page_hashes(core, CONVERSATION)) <= set(tier.cached_hashes())
    core.scheduler.check_invariants()
    tier.close()


def test_a_prefix_on_a_disk_judged_faster_than_computing_is_still_read(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[str, list[int]]) -> None:
    core, events = both_on_disk(tiny_qwen3_dir, tmp_path)
    tier, kv = disk(core), core.scheduler.kv
    cost = kv.restore_cost
    assert cost is not None
    assert run(core, events, "other", OTHER)[0] == expected["other"]  # measures the reads
    assert cost.reads.measured and tier.counters.hit_pages == 6
    # The prefill measured slow (as on a GPU busy with other requests'
    # steps), by far: 10 tokens/s.
    cost.note_prefill(10**6, 10**5)
    assert cost.restore_seconds(6 * tier.file_bytes) * 2 < cost.compute_seconds(6 * PAGE)

    events.clear()
    got, cached = run(core, events, "again", CONVERSATION)
    assert got == expected["conversation"]
    assert cached == 6 * PAGE
    assert [o.cache_hits for o in in_process.step_outputs(events) if o.cache_hits] == [
        p.CacheHits(disk=6 * PAGE)]
    assert tier.counters.hit_pages == 12 and tier.counters.skipped == 0
    assert core._stats.disk_kv_skipped_total == 0
    tier.close()


def test_a_restore_judged_slower_goes_ahead_as_a_probe_every_nth_time(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[str, list[int]]) -> None:
    core, events = both_on_disk(tiny_qwen3_dir, tmp_path)
    tier, kv = disk(core), core.scheduler.kv
    # Every restore is judged slower, and every second one goes ahead.
    kv.restore_cost = kv.restores.cost = RestoreCost(probe_every=2)  # type: ignore[union-attr]
    kv.restore_cost.note_read(1, 1.0)
    kv.restore_cost.note_prefill(10**6, 1.0)
    assert run(core, events, "other", OTHER) == (expected["other"], 0)
    assert tier.counters.skipped == 1 and tier.counters.hit_pages == 0
    assert run(core, events, "again", CONVERSATION) == (expected["conversation"], 6 * PAGE)
    assert tier.counters.skipped == 1 and tier.counters.hit_pages == 6
    tier.close()
