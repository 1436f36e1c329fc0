"""The context cache's tiers under an agent workload (issue 15's benchmark):
many long conversations, each turn resending its whole history, served by a
device KV pool that holds only a quarter of the working set.

    PYTHONPATH=. python tests/perf/bench_gpu_kv_tiers.py [--conversations 8] [--turns 4]
        [--only off,host,disk,restart] [--disk-dir DIR] [--disk-restore-ms 300] [--smoke]

The workload, in-process through the engine's own step loop (random weights
at the Qwen3-8B shape, bf16): each conversation is a seeded run of random
tokens whose length at its last turn is uniform in 16k..32k; each turn's
prompt is the one before plus 1-2k tokens (standing in for the previous
answer and the next message or tool output; the generated answer itself is
discarded, so every configuration sees the very same prompts), and asks for
a 32-token greedy answer (ignore_eos). Agents take turns: a few
conversations are in flight at once (--in-flight, default conversations/8,
at least 2), and a conversation's next turn is submitted only after its
answer, behind every other conversation waiting its turn, so it returns
after the rest of the working set went through the device. The device pool
is a quarter of the working set (every conversation's last prompt and answer).

Configurations, each a new engine over the same weights:
- off: the device prefix cache alone (LRU with the cyclic returns: every turn
  computes its whole history again);
- host: a host RAM tier holding what the device cannot (--host-share of it);
- disk: a host tier of half that (--disk-host-share) and a disk tier behind
  it (--disk-kv-path), which then serves the least recently used returns;
  shut down at the end, so the host tier's pages are written out;
- restart: a new engine over the same disk directory, the same workload.
For each: prompt tokens computed and served from the cache, mean and p95 time
to first token (from submission, waiting included), total time, and the
tiers' counters (EngineStats deltas).

Then, in the host configuration: a returning 16k-token conversation whose
pages were pushed out of the device to the host tier, its TTFT against
computing the same prompt from scratch (the issue asks >= 5x), resent as it
was and with a 1k-token new turn; and the host-to-device bandwidth of its
restore (page bytes loaded over the time of the copies, timed alone) against
a page-locked 1 GiB torch copy's.

Default sizes and time on the H200, estimated from the measured 8B prefill
(44k tok/s at 1k tokens, 34k at 8k, 19k at 32k: docs/performance.md): 8
conversations x 4 turns, the issue's conversations (16-32k, 1-2k tokens a
turn) but a quarter of its 32 and half its 8 turns: a 195k-token working set
(29 GB of bf16 K/V), a 49k-token device pool, a 25 GB page-locked host tier
(12 GB in disk and restart). "off" computes all 706k prompt tokens (~30 s);
"host" ~195k of them plus 24 restores of ~3 GB (~12 s, and ~5 s for the
returning conversation); "disk" reads pages back on two reader threads
(each page checksummed on one core) while the engine steps the other
conversations, one restore at a time, a returning turn waiting for at most
--disk-restore-ms (the engine's 300 ms) before it computes the rest, or
computing at once where the engine has measured the disk slower than its
prefill (engine/kv/restore_cost.py; the "skipped" column, probes aside):
~1-6 s a returning turn, 25-120 s; "restart" the same for the 8 first
turns, then the host tier: 15-50 s; four engine builds and pinning
the host tiers ~50 s. About 3 minutes, 4.5 at worst: no configuration
submits a turn after --max-config-seconds (120 s; its row is then starred
and covers the turns done). `--conversations 32 --turns 8` is the issue's
full workload: 5.1M prompt tokens in "off" alone (~4 min), so run it one
configuration a call (--only off, --only host, --only disk,restart) with
--max-config-seconds 500; its host tier (100 GB) is then cut to what the
engine may take of a 128 GiB host (it logs a warning; the row shows it).

--smoke runs every part on the CPU at a tiny shape in seconds
(tests/test_perf_smoke.py). Prints a table; writes every figure to
$OUT/bench_gpu_kv_tiers.json when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import protocol as p
from engine.kv.host_tier import KVTransfers
from engine.process.bootstrap import assemble_engine
from engine.scheduling.core import EngineCore
from tests.perf.agent_workload import Driver, Sizes, Workload, run_workload
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB, hf_config, random_model

CONFIGS = ("off", "host", "disk", "restart")
# Tiers are sized with this slack over the pages they must hold: partial
# pages and the answers' pages take device room too.
SLACK = 1.15


GPU_SIZES = Sizes("qwen3-8b", 8, 4, (16384, 32768), (1024, 2048), 32, 2, 16, 8192, 16384, 1024)
SMOKE_SIZES = Sizes("tiny", 4, 3, (1536, 2560), (128, 256), 4, 2, 16, 256, 1024, 64)


class Bench:
    """The model, built once, and engines around it that share one model path
    (the disk tier's directory and the prefix digests derive from it)."""

    def __init__(self, sizes: Sizes, smoke: bool, disk_dir: Path) -> None:
        self.sizes = sizes
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype_name = "float32" if smoke else "bfloat16"
        dtype = torch.float32 if smoke else torch.bfloat16
        self.loaded = random_model(sizes.shape, self.device, dtype=dtype)
        self.marker = Path(tempfile.mkdtemp(prefix="roundhouse-kv-tiers-")) / "config.json"
        self.marker.write_text(json.dumps(hf_config(sizes.shape)))
        self.disk_dir = disk_dir
        self.disk_free_bytes = shutil.disk_usage(disk_dir).free
        config = self.loaded.config
        self.bytes_per_token = (2 * config.num_layers * config.num_kv_heads * config.head_dim
                                * dtype.itemsize)
        self.workload = Workload(sizes)
        ps = sizes.page_size
        longest = max(sizes.final_tokens[1], sizes.returning_tokens + sizes.returning_new_tokens)
        self.max_context = _round_up(longest + sizes.answer_tokens + ps, ps)
        working = self.workload.working_set_tokens
        # At least one longest prompt with its answer, or nothing is ever admitted.
        self.device_tokens = max(_round_up(int(working * sizes.device_share), ps),
                                 self.max_context + 2 * ps)
        self.below_device = max(working - self.device_tokens, 0)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def tier_options(self, config: str) -> dict[str, Any]:
        sizes = self.sizes
        if config == "off":
            return {}
        share = sizes.host_share if config == "host" else sizes.disk_host_share
        options: dict[str, Any] = {
            "host_kv_mib": _mib(share * self.below_device * SLACK * self.bytes_per_token)}
        if config in ("disk", "restart"):
            # The whole working set, as far as the disk has room for it.
            working = self.workload.working_set_tokens * self.bytes_per_token
            budget = min(working, 0.8 * self.disk_free_bytes)
            options.update(disk_kv_path=str(self.disk_dir), disk_kv_mib=_mib(budget),
                           disk_kv_restore_ms=sizes.disk_restore_ms)
        return options

    def engine(self, config: str) -> tuple[EngineCore, list[p.EngineEvent]]:
        sizes = self.sizes
        events: list[p.EngineEvent] = []
        options = p.EngineOptions(
            device=self.device.type, dtype=self.dtype_name, page_size=sizes.page_size,
            max_concurrency=sizes.in_flight, max_batched_tokens=sizes.max_batched_tokens,
            max_context=self.max_context, kv_capacity_tokens=self.device_tokens,
            **self.tier_options(config))
        core, _ = assemble_engine(self.loaded, self.marker, options, lambda f, m: None,
                                  events.append)
        return core, events


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mib(nbytes: float) -> int:
    return max(1, math.ceil(nbytes / 2**20))


def push_device_cache_to_host(core: EngineCore) -> None:
    """Evict every cached device page into the host tier, as an admission
    that needed the whole pool would (standing in for other conversations)."""
    kv = core.scheduler.kv
    pages = kv.pool.allocate(kv.pool.num_free)
    core.runner.move_kv(kv.take_transfers())
    kv.pool.release(pages)
    core.scheduler.check_invariants()


def measure_returning(bench: Bench, driver: Driver) -> dict[str, Any]:
    """A returning conversation restored from the host tier against the same
    prompt computed from scratch (docstring)."""
    core = driver.core
    sizes, ps = bench.sizes, bench.sizes.page_size
    rng = np.random.default_rng(77)
    history = rng.integers(0, QWEN3_TEXT_VOCAB, sizes.returning_tokens).tolist()
    new_turn = history + rng.integers(0, QWEN3_TEXT_VOCAB, sizes.returning_new_tokens).tolist()
    fresh = rng.integers(0, QWEN3_TEXT_VOCAB, len(new_turn)).tolist()
    result: dict[str, Any] = {"history_tokens": len(history), "new_tokens": len(new_turn) -
                              len(history)}
    result["recompute_resent_s"] = driver.alone("scratch-history", history)
    result["recompute_new_turn_s"] = driver.alone("scratch-new-turn", fresh)
    result["device_hit_resent_s"] = driver.alone("device-hit", history)
    for label, prompt in (("resent", history), ("new_turn", new_turn)):
        push_device_cache_to_host(core)
        rid = f"restored-{label}"
        result[f"restored_{label}_s"] = driver.alone(rid, prompt)
        hits = driver.hits[rid]
        assert hits.host == (len(history) - (label == "resent")) // ps * ps, hits
        result[f"speedup_{label}"] = result[f"recompute_{label}_s"] / result[f"restored_{label}_s"]
    result["meets_5x"] = result["speedup_resent"] >= 5 and result["speedup_new_turn"] >= 5
    # The copies alone: the loop waits for the device before and after them.
    push_device_cache_to_host(core)
    timed: list[tuple[int, float]] = []
    original: Callable[[KVTransfers], None] = core.runner.move_kv

    def move_timed(transfers: KVTransfers) -> None:
        bench.sync()
        started = time.perf_counter()
        original(transfers)
        bench.sync()
        timed.append((len(transfers.loads), time.perf_counter() - started))

    core.runner.move_kv = move_timed  # type: ignore[method-assign]
    try:
        driver.alone("restored-timed", history)
    finally:
        del core.runner.move_kv
    host = core.scheduler.kv.host
    assert host is not None
    pages = sum(loads for loads, _ in timed)
    seconds = sum(s for loads, s in timed if loads)
    result.update(restored_pages=pages, restored_bytes=pages * host.page_bytes,
                  restore_copy_s=seconds,
                  host_to_device_Bps=pages * host.page_bytes / seconds if seconds else None)
    return result


def pinned_copy_rate(device: torch.device, nbytes: int = 1 << 30) -> float:
    """A page-locked host tensor copied to the device, bytes/s (median of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del host, target
    return nbytes / sorted(times)[len(times) // 2]


def close(core: EngineCore, shutdown: bool) -> float:
    """Stop an engine's tiers; a shutdown first writes the host tier's pages
    to the disk tier (bounded: engine/kv/disk_tier.py). Its seconds."""
    started = time.perf_counter()
    kv = core.scheduler.kv
    if shutdown:
        core.handle(p.Shutdown())
    elif kv.disk is not None:
        kv.disk.close()
    seconds = time.perf_counter() - started
    if core.runner.host_kv is not None:
        core.runner.host_kv.release()
    return seconds


def run_config(bench: Bench, config: str, index: int) -> dict[str, Any]:
    core, events = bench.engine(config)
    driver = Driver(core, events, bench.sync)
    disk = core.scheduler.kv.disk
    result: dict[str, Any] = {"options": bench.tier_options(config)}
    if disk is not None:
        result["disk_pages_at_start"] = disk.num_cached
    try:
        result.update(run_workload(driver, bench.workload, bench.sizes, warm_seed=index))
        if config == "host":
            result["returning"] = measure_returning(bench, driver)
    finally:
        result["shutdown_s"] = close(core, shutdown=config == "disk")
        # Every reference to the engine goes before its memory is given back.
        del core, events, driver, disk
        gc.collect()
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{results['device']}, {results['shape']}: {results['conversations']} conversations "
          f"x {results['turns']} turns, working set {results['working_set_tokens']} tokens, "
          f"device pool {results['device_pool_tokens']}")
    print(f"{'config':8} {'computed':>10} {'cached':>10} {'TTFT mean':>10} {'p95':>8} "
          f"{'total s':>8} {'host hit':>9} {'disk hit':>9} {'partial':>8} {'deadline':>8} "
          f"{'skipped':>8}")
    for config in CONFIGS:
        row = results["configs"].get(config)
        if row is None:
            continue
        c = row["counters"]
        name = f"{config}*" if row["capped"] else config
        print(f"{name:8} {row['computed_tokens']:>10} {row['cached_tokens']:>10} "
              f"{row['ttft_mean_s'] * 1e3:>8.0f}ms {row['ttft_p95_s'] * 1e3:>6.0f}ms "
              f"{row['total_s']:>8.1f} {c['host_kv_hit_tokens_total']:>9} "
              f"{c['disk_kv_hit_tokens_total']:>9} {c['partial_kv_hit_tokens_total']:>8} "
              f"{c['disk_kv_deadline_hits_total']:>8} {c['disk_kv_skipped_total']:>8}")
    if any(row["capped"] for row in results["configs"].values()):
        print(f"* stopped submitting turns after {results['sizes']['max_config_seconds']:g} s")
    back = results["configs"].get("host", {}).get("returning")
    if back:
        print(f"returning {back['history_tokens']}-token conversation from the host tier: "
              f"resent {back['restored_resent_s'] * 1e3:.0f} ms vs recomputed "
              f"{back['recompute_resent_s'] * 1e3:.0f} ms ({back['speedup_resent']:.1f}x); "
              f"+{back['new_tokens']} new tokens {back['restored_new_turn_s'] * 1e3:.0f} vs "
              f"{back['recompute_new_turn_s'] * 1e3:.0f} ms ({back['speedup_new_turn']:.1f}x); "
              f"a device hit {back['device_hit_resent_s'] * 1e3:.0f} ms")
        rate, pinned = back["host_to_device_Bps"], results.get("pinned_copy_Bps")
        if rate and pinned:
            print(f"restore: {back['restored_bytes'] / 1e9:.2f} GB in "
                  f"{back['restore_copy_s'] * 1e3:.0f} ms = {rate / 1e9:.1f} GB/s, "
                  f"{rate / pinned:.0%} of the pinned copy rate {pinned / 1e9:.1f} GB/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--in-flight", type=int)
    parser.add_argument("--shape", help="a tests/perf/gpu_models.py shape")
    parser.add_argument("--host-share", type=float)
    parser.add_argument("--disk-host-share", type=float)
    parser.add_argument("--disk-restore-ms", type=int)
    parser.add_argument("--max-config-seconds", type=float)
    parser.add_argument("--disk-dir", type=Path, help="kept afterwards (default: a temporary one)")
    args = parser.parse_args()
    wanted = set(args.only.split(","))
    if wanted - set(CONFIGS):
        parser.error(f"--only takes {','.join(CONFIGS)}")
    if "restart" in wanted and "disk" not in wanted:
        parser.error("restart needs disk in the same run (it restarts over its directory)")
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    overrides = {name: getattr(args, name) for name in (
        "conversations", "turns", "in_flight", "shape", "host_share", "disk_host_share",
        "disk_restore_ms", "max_config_seconds") if getattr(args, name) is not None}
    if args.conversations and not args.in_flight and not args.smoke:
        overrides["in_flight"] = max(2, args.conversations // 8)
    sizes = replace(sizes, **overrides)
    disk_dir = args.disk_dir or Path(tempfile.mkdtemp(prefix="roundhouse-disk-kv-"))
    bench = Bench(sizes, args.smoke, disk_dir)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "shape": sizes.shape,
        "device": "cpu" if args.smoke else torch.cuda.get_device_name(),
        "sizes": asdict(sizes), "conversations": sizes.conversations, "turns": sizes.turns,
        "working_set_tokens": bench.workload.working_set_tokens,
        "device_pool_tokens": bench.device_tokens, "bytes_per_token": bench.bytes_per_token,
        "disk_dir": str(disk_dir), "disk_free_bytes": bench.disk_free_bytes,
        "configs": {}}
    print(f"working set {bench.workload.working_set_tokens} tokens "
          f"({bench.workload.working_set_tokens * bench.bytes_per_token / 1e9:.1f} GB), "
          f"device pool {bench.device_tokens} tokens, {bench.workload.prompt_tokens} prompt "
          f"tokens in all", flush=True)
    if bench.device.type == "cuda":
        results["pinned_copy_Bps"] = pinned_copy_rate(bench.device)
    out = os.environ.get("OUT")
    began = time.perf_counter()
    try:
        for index, config in enumerate(CONFIGS):
            if config not in wanted:
                continue
            results["configs"][config] = run_config(bench, config, index)
            print(f"[{time.perf_counter() - began:.0f} s] {config}",
                  json.dumps(results["configs"][config]), flush=True)
            if out:  # after each: a run cut short keeps what it measured
                Path(out, "bench_gpu_kv_tiers.json").write_text(json.dumps(results, indent=2))
    finally:
        if args.disk_dir is None:
            shutil.rmtree(disk_dir, ignore_errors=True)
        shutil.rmtree(bench.marker.parent, ignore_errors=True)
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
