"""The prefix cache's disk tier on CUDA: pages leave page-locked host slots
(bfloat16) for files and come back, after a restart, bit for bit, giving the
tokens of a device hit. Run on the lent GPU: pytest -m gpu this file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution.host_kv import HostKVPool
from engine.kv.host_tier import KVTransfers
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import step_outputs
from tests.engine.test_host_kv_tier_gpu import PAGE, greedy, prompt, qwen3_bf16, run

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
    # Whole pages only, as the disk tier keeps (see test_host_kv_tier_gpu.py).
    conversation = prompt(1, 18 * PAGE + 1)
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


def test_a_restore_read_off_the_loop_while_another_request_decodes_restores_bit_for_bit(
        qwen3_bf16: Path, tmp_path: Path) -> None:
    """After a restart, a request decodes (CUDA graphs) while a returning
    conversation's pages are read by the reader threads into page-locked
    slots and copied on to the device on the side stream: the restored
    pages hold the K/V of before, bit for bit (tokens are not compared: the
    batch differs from the run before, and bf16 results with it)."""
    core, events = make_engine(qwen3_bf16, tmp_path)
    conversation, other = prompt(1, 18 * PAGE + 1), prompt(2, 40)
    run(core, events, {"first": conversation})
    full_pages = (len(conversation) - 1) // PAGE
    pool = core.scheduler.kv.pool
    hashes = list(pool._by_hash)[:full_pages]
    pages = [pool._by_hash[h] for h in hashes]
    kv_before = [(k[pages].cpu(), v[pages].cpu()) for k, v in core.runner.kv_caches]
    core.handle(p.Shutdown())

    restarted, restarted_events = make_engine(qwen3_bf16, tmp_path)
    disk = restarted.scheduler.kv.disk
    assert disk is not None and set(hashes) <= set(disk.cached_hashes())
    restarted_events.clear()
    restarted.handle(p.Generate("other", other, greedy()))
    while not restarted.scheduler.running or restarted.scheduler.running[0].is_prefilling:
        restarted.step()
    restarted.handle(p.Generate("restored", conversation, greedy()))
    while restarted.has_work:
        restarted.step()
        restarted.scheduler.check_invariants()
    outputs = step_outputs(restarted_events)
    for name in ("other", "restored"):
        assert sum(len(o.token_ids) for o in outputs if o.request_id == name) == 16
    assert [o for o in outputs if o.request_id == "restored"][-1].num_cached_tokens \
        == full_pages * PAGE
    assert disk.counters.hit_pages == full_pages and disk.counters.deadline_hits == 0
    assert restarted.scheduler.kv.host.num_reserved == 0  # type: ignore[union-attr]
    pool = restarted.scheduler.kv.pool
    restored = [pool._by_hash[h] for h in hashes]
    for (k, v), (k_before, v_before) in zip(restarted.runner.kv_caches, kv_before, strict=True):
        assert k[restored].cpu().equal(k_before) and v[restored].cpu().equal(v_before)
    disk.close()


def test_a_slot_read_on_the_host_waits_only_for_the_copies_that_touched_it() -> None:
    """The disk tier's reader threads (slot_view) and spills (slot_bytes)
    wait for the last copies of their own slot, not for the side stream,
    which waits for the compute stream's step in flight."""
    device = torch.device("cuda")
    layers = 2
    kv = [(torch.randn(8, PAGE, 2, 64, device=device, dtype=torch.bfloat16),
           torch.randn(8, PAGE, 2, 64, device=device, dtype=torch.bfloat16))
          for _ in range(layers)]
    pool = HostKVPool(4, num_layers=layers, page_size=PAGE, num_kv_heads=2, head_dim=64,
                      dtype=torch.bfloat16, device=device)
    busy = torch.randn(8192, 8192, device=device)
    for _ in range(30):
        busy = busy @ busy  # a long step in flight on the compute stream
    pool.run(KVTransfers(stores=[(3, 0)]), kv)  # queued behind it
    untouched = pool.slot_view(1)
    assert not torch.cuda.current_stream(device).query(), "waited for the compute stream"
    assert len(untouched) == pool.page_bytes
    stored = pool.slot_bytes(0)  # waits for its store (and so for the step)
    expected = torch.stack([torch.stack([k[3], v[3]]) for k, v in kv]).cpu()
    assert stored == expected.view(torch.uint8).numpy().tobytes()
    del busy
