"""The prefix cache's disk tier on CUDA: pages leave page-locked host slots
(bfloat16) for files and come back, after a restart, bit for bit, giving the
tokens of a device hit. Run on the lent GPU: pytest -m gpu this file."""

from __future__ import annotations

from pathlib import Path

import pytest

import protocol as p
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.test_host_kv_tier_gpu import PAGE, prompt, qwen3_bf16, run

pytestmark = pytest.mark.gpu
__all__ = ["qwen3_bf16"]  # the module's fixture, shared


def make_engine(model: Path, directory: Path) -> tuple[EngineCore, list[p.EngineEvent]]:
    return in_process.make_engine(model, device="cuda", dtype="bfloat16", page_size=PAGE,
                                  max_concurrency=2, max_batched_tokens=128,
                                  kv_capacity_tokens=512, output_window=16, host_kv_mib=64,
                                  disk_kv_path=str(directory), disk_kv_mib=256)


def test_a_prefix_restored_from_disk_after_a_restart_matches_a_device_hit(
        qwen3_bf16: Path, tmp_path: Path) -> None:
    core, events = make_engine(qwen3_bf16, tmp_path)
    conversation = prompt(1)
    run(core, events, {"first": conversation})
    hit, cached = run(core, events, {"device-hit": conversation})["device-hit"]
    full_pages = (len(conversation) - 1) // PAGE
    assert cached == full_pages * PAGE
    pool = core.scheduler.kv.pool
    hashes = list(pool._by_hash)[:full_pages]
    pages = [pool._by_hash[h] for h in hashes]
    kv_before = [(k[pages].cpu(), v[pages].cpu()) for k, v in core.runner.kv_caches]
    core.handle(p.Shutdown())

    restarted, restarted_events = make_engine(qwen3_bf16, tmp_path)
    disk = restarted.scheduler.kv.disk
    assert disk is not None and set(hashes) <= set(disk.cached_hashes())
    tokens, cached_again = run(restarted, restarted_events,
                               {"restored": conversation})["restored"]
    assert tokens == hit and cached_again == cached
    assert disk.counters.hit_pages == full_pages and disk.counters.corrupt_pages == 0
    pool = restarted.scheduler.kv.pool
    restored = [pool._by_hash[h] for h in hashes]
    for (k, v), (k_before, v_before) in zip(restarted.runner.kv_caches, kv_before, strict=True):
        assert k[restored].cpu().equal(k_before) and v[restored].cpu().equal(v_before)
    disk.close()
