"""The prefix cache's disk tier in the whole engine (CPU): pages the host tier
evicts go to files, come back with exactly the tokens computed from scratch,
survive a restart, and a damaged, foreign or unwritable file never changes
what is generated.

Tiny pools throughout: 16 device pages of 8 tokens and a host tier cut to 8
slots (its size is in MiB, far more than 8 pages of this model), so a 50-token
prompt's pages reach the disk after a few other prompts.
"""

from __future__ import annotations

import dataclasses
import errno
from pathlib import Path

import pytest

import protocol as p
from engine.kv import disk_tier as disk_tier_module
from engine.kv.disk_chains import parse_file_name
from engine.kv.disk_tier import DiskTier
from engine.kv.kv_sizing import HostKvPlan
from engine.process import bootstrap
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import step_outputs
from tests.engine.test_host_kv_tier import (
    PAGE,
    SMALL_POOL,
    greedy,
    on_device,
    page_hashes,
    prompt,
    run,
)

HOST_SLOTS = 8


@pytest.fixture(autouse=True)
def small_host_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = bootstrap.plan_host_kv

    def capped(*args: object) -> HostKvPlan:
        planned = plan(*args)  # type: ignore[arg-type]
        return dataclasses.replace(planned, num_slots=min(planned.num_slots, HOST_SLOTS))

    monkeypatch.setattr(bootstrap, "plan_host_kv", capped)


def make_engine(model: Path, directory: Path | None, **overrides: object
                ) -> tuple[EngineCore, list[p.EngineEvent]]:
    disk: dict[str, object] = ({"disk_kv_path": str(directory), "disk_kv_mib": 1}
                               if directory is not None else {})
    return in_process.make_engine(model, **{**SMALL_POOL, "host_kv_mib": 1, **disk,
                                            **overrides})


def disk(core: EngineCore) -> DiskTier:
    tier = core.scheduler.kv.disk
    assert tier is not None
    return tier


def push_to_disk(core: EngineCore, events: list[p.EngineEvent], tokens: list[int]) -> None:
    """Run other prompts until every page of tokens is on disk only."""
    hashes = page_hashes(core, tokens)
    host = core.scheduler.kv.host
    assert host is not None
    for seed in range(100, 110):
        run(core, events, f"other-{seed}", prompt(seed))
        if not (set(hashes) & set(host.cached_hashes())
                or any(on_device(core, h) for h in hashes)):
            break
    assert disk(core).flush(10)
    assert not any(on_device(core, h) for h in hashes)
    assert not set(hashes) & set(host.cached_hashes())
    assert set(hashes) <= set(disk(core).cached_hashes())


def page_files(core: EngineCore, tokens: list[int]) -> list[Path]:
    tier = disk(core)
    return [tier.file_path(h) for h in page_hashes(core, tokens)]


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir: Path) -> dict[int, list[int]]:
    """Greedy tokens of prompt(seed), computed with no tier at all."""
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_POOL)
    return {seed: run(core, events, f"scratch-{seed}", prompt(seed))[0] for seed in (1, 2, 3)}


def test_a_prefix_restored_from_disk_gives_the_tokens_computed_from_scratch(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[int, list[int]]) -> None:
    core, events = make_engine(tiny_qwen3_dir, tmp_path)
    tier = disk(core)
    assert tier.directory.parent.parent == tmp_path  # DIR/<artifact>/<format>/
    conversation = prompt(1)
    assert run(core, events, "first", conversation) == (expected[1], 0)
    push_to_disk(core, events, conversation)
    host_hits = core.scheduler.kv.host.counters.hit_pages  # type: ignore[union-attr]

    got, cached = run(core, events, "again", conversation)
    assert got == expected[1]
    assert cached == 6 * PAGE  # every full page before the last token, from disk
    counters = tier.counters
    assert counters.hit_pages == 6 and counters.hit_tokens == 48
    assert counters.bytes_read == 6 * tier.file_bytes
    assert counters.corrupt_pages == counters.deadline_hits == 0
    # The host tier passed them on but did not serve them.
    assert core.scheduler.kv.host.counters.hit_pages == host_hits  # type: ignore[union-attr]
    stats = core._stats
    assert stats.disk_kv_hit_pages_total == 6 and stats.disk_kv_hit_tokens_total == 48
    assert stats.disk_kv_written_pages_total == counters.written_pages > 0
    assert stats.disk_kv_bytes_written_total == counters.written_pages * tier.file_bytes
    assert stats.disk_kv_pages_cached == tier.num_cached
    assert stats.disk_kv_capacity_bytes == 2**20
    core.scheduler.check_invariants()
    tier.close()


def test_a_request_waiting_for_room_reads_its_disk_pages_once_when_admitted(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[int, list[int]]) -> None:
    """While a long request holds most of the pool, a prompt whose pages are
    on disk waits: its admission is refused at every step without reading a
    page or moving one in the host tier; once it fits, it reads each page
    once, counted in the disk tier alone, and gives the tokens computed from
    scratch."""
    core, events = make_engine(tiny_qwen3_dir, tmp_path)
    tier, host = disk(core), core.scheduler.kv.host
    assert host is not None
    conversation = prompt(1)
    run(core, events, "first", conversation)
    push_to_disk(core, events, conversation)
    # 97 prompt tokens and 6 more fill 13 of the 16 pages (14 reserved), and
    # its decode needs no new page, so it evicts nothing while the other waits.
    events.clear()
    core.handle(p.Generate("blocker", prompt(7, 97), greedy(6)))
    scheduler = core.scheduler
    while not scheduler.running or scheduler.running[0].is_prefilling:
        core.step()
    read, evicted = tier.counters.bytes_read, host.counters.evicted_pages
    before = core._stats
    disk_hits, host_hits, cached = (before.disk_kv_hit_tokens_total,
                                    before.host_kv_hit_tokens_total, before.cached_tokens_total)
    core.handle(p.Generate("again", conversation, greedy()))
    waited = 0
    while True:
        core.step()
        scheduler.check_invariants()
        # Waiting for room, not for its pages (it fits once their reads begin).
        if not any(seq.request_id == "again" and not scheduler.kv.is_restoring(seq)
                   for seq in scheduler.waiting):
            break
        waited += 1
        assert tier.counters.bytes_read == read and host.counters.evicted_pages == evicted
    assert waited >= 3
    while core.has_work:
        core.step()
        scheduler.check_invariants()
    outputs = [o for o in step_outputs(events) if o.request_id == "again"]
    assert [t for o in outputs for t in o.token_ids] == expected[1]
    assert outputs[-1].num_cached_tokens == 6 * PAGE
    assert [o.cache_hits for o in outputs if o.cache_hits] == [p.CacheHits(disk=6 * PAGE)]
    assert tier.counters.bytes_read - read == 6 * tier.file_bytes
    stats = core._stats
    assert stats.disk_kv_hit_tokens_total - disk_hits == 6 * PAGE
    assert stats.host_kv_hit_tokens_total == host_hits
    assert stats.cached_tokens_total - cached == 6 * PAGE
    tier.close()


@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign-format", "foreign-model"])
def test_a_damaged_or_foreign_page_file_is_a_miss_and_is_deleted(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[int, list[int]],
        damage: str) -> None:
    core, events = make_engine(tiny_qwen3_dir, tmp_path)
    tier = disk(core)
    conversation = prompt(2)
    run(core, events, "first", conversation)
    push_to_disk(core, events, conversation)
    files = page_files(core, conversation)
    victim = files[3]
    data = bytearray(victim.read_bytes())
    if damage == "flipped":
        data[-100] ^= 0x01
    elif damage == "truncated":
        del data[len(data) // 2 :]
    elif damage == "foreign-format":
        data[12:28] = bytes(16)  # the header's KV format digest
    if damage == "foreign-model":
        # Another model's page of the same name (copied between directories):
        # its header names the same format and hash, its bytes are other K/V
        # with a checksum that matches them, and its tokens are others.
        from engine.kv.disk_pages import page_header
        payload = bytes(tier.page_bytes)
        page_hash = page_hashes(core, conversation)[3]
        victim.write_bytes(page_header(tier.kv_format, page_hash, [7] * PAGE, payload) + payload)
    else:
        victim.write_bytes(bytes(data))

    got, cached = run(core, events, "again", conversation)
    assert got == expected[2]
    assert cached == 3 * PAGE  # the pages before the damaged one
    assert tier.counters.hit_pages == 3 and tier.counters.corrupt_pages == 1
    assert not victim.exists() and page_hashes(core, conversation)[3] not in tier.cached_hashes()
    # The pages after it, which no lookup reaches now, are gone too.
    assert not any(f.exists() for f in files[4:])
    assert not set(page_hashes(core, conversation)[4:]) & set(tier.cached_hashes())
    assert core._stats.disk_kv_corrupt_pages_total == 1
    tier.close()


def test_a_full_disk_leaves_serving_unaffected(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[int, list[int]],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def full(path: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return open(path, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(disk_tier_module, "open", full, raising=False)
    core, events = make_engine(tiny_qwen3_dir, tmp_path)
    tier = disk(core)
    for seed in (1, 2, 3):
        assert run(core, events, f"r{seed}", prompt(seed))[0] == expected[seed]
    for seed in range(100, 106):
        run(core, events, f"other-{seed}", prompt(seed))
    assert tier.flush(10)
    assert run(core, events, "again", prompt(1))[0] == expected[1]
    counters = tier.counters
    assert counters.dropped_pages > 0 and counters.written_pages == 0 and tier.num_cached == 0
    assert list(tier.directory.iterdir()) == []  # no temporary file left behind
    assert core._stats.disk_kv_dropped_pages_total == counters.dropped_pages
    full_disk_lines = [r for r in caplog.records if "the disk is full" in r.getMessage()]
    assert len(full_disk_lines) == 1  # logged once
    tier.close()


def test_pages_resident_at_shutdown_are_written_and_a_restart_serves_them(
        tiny_qwen3_dir: Path, tmp_path: Path, expected: dict[int, list[int]]) -> None:
    core, events = make_engine(tiny_qwen3_dir, tmp_path)
    conversation = prompt(3)
    run(core, events, "first", conversation)
    hashes = page_hashes(core, conversation)
    # Other prompts push the conversation's pages off the device (to the
    # host tier, some perhaps further, to the disk).
    for seed in range(100, 110):
        run(core, events, f"other-{seed}", prompt(seed))
        if not any(on_device(core, h) for h in hashes):
            break
    host = core.scheduler.kv.host
    assert host is not None and disk(core).flush(10)
    resident = [h for _, _, h, _ in host.resident()]
    assert set(hashes) & set(resident)
    assert not set(resident) <= set(disk(core).cached_hashes())
    core.handle(p.Shutdown())
    assert set(resident) <= {parse_file_name(f.name)[0]  # type: ignore[index]
                             for f in disk(core).directory.iterdir()}

    restarted, restarted_events = make_engine(tiny_qwen3_dir, tmp_path)
    tier = disk(restarted)
    assert set(resident) <= set(tier.cached_hashes())
    got, cached = run(restarted, restarted_events, "after-restart", conversation)
    assert got == expected[3]
    assert cached == 6 * PAGE and tier.counters.hit_pages == 6
    tier.close()


def test_another_kv_format_does_not_see_the_pages(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir, tmp_path)
    run(core, events, "first", prompt(1))
    # Its pages are on the device only: the shutdown writes them through the host tier.
    assert core.scheduler.kv.host.num_cached == 0  # type: ignore[union-attr]
    core.handle(p.Shutdown())
    assert disk(core).num_cached == 7  # 58 tokens computed: 7 full pages
    other, _ = make_engine(tiny_qwen3_dir, tmp_path, page_size=16)
    tier = disk(other)
    assert tier.num_cached == 0
    assert tier.directory.parent == disk(core).directory.parent  # same model, other format
    tier.close()


def test_off_without_a_path(tiny_qwen3_dir: Path) -> None:
    core, _ = make_engine(tiny_qwen3_dir, None)
    host = core.scheduler.kv.host
    assert core.scheduler.kv.disk is None and host is not None and host.on_evict is None
