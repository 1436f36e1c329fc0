"""Restores from the disk tier run off the engine's loop (CPU): while a
request's pages are read back, the other requests keep stepping and a
request behind it may go in; the restored request gives the tokens computed
from scratch, whether its restore ends complete, at its deadline or at a
page damaged meanwhile; a shutdown in the middle stops the readers cleanly.

The readers' read_page is wrapped by a gate that holds chosen pages' reads
until the test opens it, so "while a restore is in progress" is a state the
test controls rather than a race it hopes to win.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import protocol as p
from engine.kv import disk_reader
from engine.kv.disk_chains import parse_file_name
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.test_disk_kv_tier import (
    disk,
    make_engine,
    page_files,
    push_to_disk,
    small_host_tier,
)
from tests.engine.test_host_kv_tier import PAGE, SMALL_POOL, greedy, page_hashes, prompt, run

pytestmark = pytest.mark.usefixtures("small_host_tier")
__all__ = ["small_host_tier"]  # the fixture, shared

CONVERSATION = prompt(1)
RUNNER = prompt(20, 10)  # decodes while the conversation's pages are read
LATER = prompt(21, 10)  # arrives behind the conversation


class Gate:
    """Holds the readers' reads of the pages in `held` (all: None) until
    open(); counts the reads that reached it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.held: set[bytes] | None = None
        self.reads: list[bytes] = []
        real = disk_reader.read_page

        def read_page(path: Path, kv_format: bytes, page_hash: bytes, tokens: object,
                      into: memoryview) -> disk_reader.PageRead:
            self.reads.append(page_hash)
            if self.held is None or page_hash in self.held:
                assert self.opened.wait(30), "the test never opened the gate"
            return real(path, kv_format, page_hash, tokens, into)  # type: ignore[arg-type]

        monkeypatch.setattr(disk_reader, "read_page", read_page)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    gate = Gate(monkeypatch)
    yield gate
    gate.open()  # never leave a reader blocked


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, computed with no tier at all."""
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_POOL)
    return {"again": run(core, events, "a", CONVERSATION)[0],
            "runner": run(core, events, "r", RUNNER, greedy(30))[0],
            "later": run(core, events, "l", LATER, greedy(4))[0]}


def prepared(model: Path, directory: Path, **overrides: object
             ) -> tuple[EngineCore, list[p.EngineEvent]]:
    """An engine whose conversation's pages are all on disk, and only there."""
    core, events = make_engine(model, directory, **overrides)
    run(core, events, "first", CONVERSATION)
    push_to_disk(core, events, CONVERSATION)
    events.clear()
    return core, events


def waiting(core: EngineCore, request_id: str) -> p.Generate | None:
    return next((s for s in core.scheduler.waiting if s.request_id == request_id), None)


def tokens_of(events: list[p.EngineEvent], request_id: str) -> list[int]:
    return [t for o in in_process.step_outputs(events) if o.request_id == request_id
            for t in o.token_ids]


def finish(core: EngineCore) -> None:
    while core.has_work:
        core.step()
        core.scheduler.check_invariants()


def settle_reads(core: EngineCore) -> None:
    """Let the readers hand back every job (the gate open) and take them."""
    kv = core.scheduler.kv
    assert kv.restores is not None
    for _ in range(100):
        kv.wait_for_reads(0.1)
        kv.poll_restores()
        if kv.host.num_reserved == 0:  # type: ignore[union-attr]
            break
    core.scheduler.check_invariants()


def test_other_requests_keep_stepping_while_a_restore_reads_and_one_behind_it_goes_in(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[str, list[int]],
        gate: Gate) -> None:
    core, events = prepared(tiny_qwen3_dir, tmp_path)
    tier, kv = disk(core), core.scheduler.kv
    core.handle(p.Generate("runner", RUNNER, greedy(30)))
    while not core.scheduler.running or core.scheduler.running[0].is_prefilling:
        core.step()
    core.handle(p.Generate("again", CONVERSATION, greedy()))
    core.handle(p.Generate("later", LATER, greedy(4)))
    steps_before = core.step_count
    for _ in range(12):
        core.step()
        core.scheduler.check_invariants()
        again = waiting(core, "again")
        assert again is not None and kv.is_restoring(again)
    # Every step ran (the loop never waited for the disk), and each one gave
    # the runner its token; "later", behind the restoring request, went in
    # and finished meanwhile.
    assert core.step_count - steps_before == 12
    per_step = [[o for o in event.outputs if o.request_id == "runner"]
                for event in events if isinstance(event, p.StepOutputs)][-11:]
    assert len(per_step) == 11
    assert all(len(outputs) == 1 and len(outputs[0].token_ids) == 1 for outputs in per_step)
    assert tokens_of(events, "later") == expected["later"]
    assert tier.counters.bytes_read == 0  # nothing read yet: the gate is shut

    gate.open()
    finish(core)
    assert tokens_of(events, "again") == expected["again"]
    assert tokens_of(events, "runner") == expected["runner"]
    again_outputs = [o for o in in_process.step_outputs(events) if o.request_id == "again"]
    assert again_outputs[-1].num_cached_tokens == 6 * PAGE
    assert [o.cache_hits for o in again_outputs if o.cache_hits] == [p.CacheHits(disk=6 * PAGE)]
    counters = tier.counters
    assert (counters.hit_pages, counters.hit_tokens) == (6, 6 * PAGE)
    assert counters.bytes_read == 6 * tier.file_bytes
    assert counters.deadline_hits == counters.corrupt_pages == 0
    assert counters.restore_seconds > 0
    stats = core._stats
    assert stats.disk_kv_restore_seconds_total == counters.restore_seconds
    assert stats.disk_kv_hit_pages_total == 6
    assert kv.host.num_reserved == 0  # type: ignore[union-attr]
    tier.close()


def test_the_deadline_admits_the_prefix_read_so_far_and_the_rest_is_computed(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[str, list[int]],
        gate: Gate) -> None:
    core, events = prepared(tiny_qwen3_dir, tmp_path, disk_kv_restore_ms=200)
    tier, kv = disk(core), core.scheduler.kv
    gate.held = set(page_hashes(core, CONVERSATION)[3:])  # pages 4 to 6 never come
    core.handle(p.Generate("again", CONVERSATION, greedy()))
    while waiting(core, "again") is not None:
        core.step()
        core.scheduler.check_invariants()
    assert tier.counters.deadline_hits == 1
    assert tier.counters.restore_seconds >= 0.2
    finish(core)
    outputs = [o for o in in_process.step_outputs(events) if o.request_id == "again"]
    assert [t for o in outputs for t in o.token_ids] == expected["again"]
    assert outputs[-1].num_cached_tokens == 3 * PAGE
    assert [o.cache_hits for o in outputs if o.cache_hits] == [p.CacheHits(disk=3 * PAGE)]
    assert (tier.counters.hit_pages, tier.counters.hit_tokens) == (3, 3 * PAGE)
    assert core._stats.disk_kv_deadline_hits_total == 1

    # The reads the deadline left behind finish later, into the host tier as
    # ordinary cached pages (or their slots freed): nothing stays reserved.
    gate.open()
    settle_reads(core)
    assert kv.host.num_reserved == 0  # type: ignore[union-attr]
    assert tier.counters.bytes_read >= 3 * tier.file_bytes
    tier.close()


def test_a_page_damaged_while_its_restore_runs_is_a_miss_and_the_rest_is_computed(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[str, list[int]],
        gate: Gate) -> None:
    core, events = prepared(tiny_qwen3_dir, tmp_path)
    tier = disk(core)
    hashes = page_hashes(core, CONVERSATION)
    gate.held = {hashes[2]}
    core.handle(p.Generate("again", CONVERSATION, greedy()))
    while hashes[2] not in gate.reads:
        core.step()
    victim = page_files(core, CONVERSATION)[2]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    gate.open()
    finish(core)
    outputs = [o for o in in_process.step_outputs(events) if o.request_id == "again"]
    assert [t for o in outputs for t in o.token_ids] == expected["again"]
    assert outputs[-1].num_cached_tokens == 2 * PAGE
    assert tier.counters.corrupt_pages == 1 and tier.counters.hit_pages == 2
    assert tier.counters.deadline_hits == 0
    assert not victim.exists() and hashes[2] not in tier.cached_hashes()
    settle_reads(core)
    tier.close()


def test_a_shutdown_during_reads_stops_the_readers_and_registers_only_whole_pages(
        tiny_qwen3_dir: Path, tmp_path: Path, gate: Gate) -> None:
    core, events = prepared(tiny_qwen3_dir, tmp_path)
    tier = disk(core)
    host = core.scheduler.kv.host
    assert host is not None
    hashes = page_hashes(core, CONVERSATION)
    payloads = {h: f.read_bytes()[-tier.page_bytes:]
                for h, f in zip(hashes, page_files(core, CONVERSATION), strict=True)}
    core.handle(p.Generate("again", CONVERSATION, greedy()))
    while not gate.reads:
        core.step()
    # The reads in progress finish while the shutdown waits for them; the
    # rest are skipped.
    threading.Timer(0.2, gate.open).start()
    core.handle(p.Shutdown())
    assert not tier.reader.alive
    assert [o.finish_reason for o in in_process.step_outputs(events)
            if o.request_id == "again"] == ["abort"]
    assert host.num_reserved == 0
    host.check_invariants()
    memory = core.runner.host_kv
    assert memory is not None
    for slot, _, page_hash, _ in host.resident():
        if page_hash in payloads:
            assert memory.slot_bytes(slot) == payloads[page_hash]
    assert set(hashes) <= {parse_file_name(f.name)[0]  # type: ignore[index]
                           for f in tier.directory.iterdir()}


def test_two_requests_restoring_at_once_take_turns_and_both_match_from_scratch(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[str, list[int]],
        gate: Gate) -> None:
    """One restore at a time (each holds its pages until admitted, and two
    could hold what both need): the second waits aside for its turn."""
    second = prompt(2)
    scratch, scratch_events = in_process.make_engine(tiny_qwen3_dir, **SMALL_POOL)
    expected_second = run(scratch, scratch_events, "s", second)[0]
    first_run, first_events = make_engine(tiny_qwen3_dir, tmp_path)
    run(first_run, first_events, "first", CONVERSATION)
    run(first_run, first_events, "second-first", second)
    first_run.handle(p.Shutdown())  # every page written: the restart has them on disk only
    core, events = make_engine(tiny_qwen3_dir, tmp_path)
    tier, kv = disk(core), core.scheduler.kv
    hashes = page_hashes(core, CONVERSATION) + page_hashes(core, second)
    assert set(hashes) <= set(tier.cached_hashes())
    core.handle(p.Generate("again", CONVERSATION, greedy()))
    core.handle(p.Generate("second", second, greedy()))
    for _ in range(3):
        core.step()
    again, other = waiting(core, "again"), waiting(core, "second")
    assert again is not None and other is not None
    assert kv.is_restoring(again) and kv.is_restoring(other)
    assert len(gate.reads) <= 6 and set(gate.reads) <= set(page_hashes(core, CONVERSATION))
    gate.open()
    finish(core)
    assert tokens_of(events, "again") == expected["again"]
    assert tokens_of(events, "second") == expected_second
    assert tier.counters.hit_pages == 12 and tier.counters.deadline_hits == 0
    tier.close()
