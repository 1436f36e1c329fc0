"""Time paged decode attention on the GPU (not a test).

    .venv/bin/python tests/perf/bench_decode_attention.py

For each (B, seq_len, Hq, Hkv, D) every row has seq_len cached tokens in
random pages of a pool; small cases rotate through several page tables over
disjoint pages so that the K/V they read in turn is larger than L2 (60 MB).
Calls are captured in a CUDA graph (launch gaps are not the kernel's) and
timed with CUDA events: median over replays. Achieved bandwidth counts the K/V
bytes a step must read, sum(seq_len) * Hkv * D * 2 bytes * 2 (K and V), and is
set against a large device-to-device copy measured here (read + write bytes).
Each case runs twice: max_seq_len = seq_len, and max_seq_len = 40960 as the
engine's CUDA graphs pass it. Writes $OUT/bench_decode_attention.json when
$OUT is set.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import decode_attention
from kernels.decode_attention import decode_workspace, paged_decode_attention

CASES = [
    # B, seq_len, Hq, Hkv, D
    (1, 1024, 16, 8, 128),
    (1, 32768, 32, 8, 128),
    (64, 1024, 16, 8, 128),
    (256, 1024, 16, 8, 128),
    (256, 4096, 32, 8, 128),
]
PAGE_SIZE = 16
GRAPH_MAX_SEQ_LEN = 40960
L2_BYTES = 60 * 2**20
MIN_CALLS_PER_GRAPH = 20
REPLAYS = 30


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy."""
    src = torch.randn(2**29, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def time_case(batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
              device: torch.device) -> dict:
    kv_bytes = batch * seq_len * num_kv_heads * head_dim * 2 * 2
    sets = max(1, min(64, math.ceil(3 * L2_BYTES / kv_bytes)))
    pages_per_row = -(-seq_len // PAGE_SIZE)
    pages_per_set = batch * pages_per_row
    num_pages = sets * pages_per_set
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    order = torch.randperm(num_pages, device=device).to(torch.int32)
    tables = [order[i * pages_per_set : (i + 1) * pages_per_set].view(batch, pages_per_row)
              .contiguous() for i in range(sets)]
    queries = [torch.randn((batch, num_heads, head_dim), device=device, dtype=torch.bfloat16)
               for _ in range(sets)]
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    out = torch.empty_like(queries[0])
    scale = 1.0 / math.sqrt(head_dim)
    result = {"batch": batch, "seq_len": seq_len, "num_heads": num_heads,
              "num_kv_heads": num_kv_heads, "head_dim": head_dim, "kv_bytes": kv_bytes,
              "page_tables": sets}
    workspace = decode_workspace(batch, num_heads, head_dim, GRAPH_MAX_SEQ_LEN, device)
    calls = max(MIN_CALLS_PER_GRAPH, sets)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for label, max_seq_len in (("tight", seq_len), ("graph", GRAPH_MAX_SEQ_LEN)):
        def step(i: int, max_seq_len: int = max_seq_len) -> None:
            paged_decode_attention(queries[i % sets], k_cache, v_cache, tables[i % sets],
                                   seq_lens, scale, max_seq_len, workspace, out=out)

        for i in range(sets):  # compile, load, warm up outside the capture
            step(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                step(i)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(REPLAYS):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        seconds = statistics.median(times)
        splits = decode_attention._num_splits(batch, num_kv_heads, max_seq_len, sms)
        result[label] = {"max_seq_len": max_seq_len, "splits": splits,
                         "ctas": splits * num_kv_heads * batch, "seconds": seconds,
                         "spread": (max(times) - min(times)) / seconds,
                         "bytes_per_second": kv_bytes / seconds}
        del graph
    return result


def main() -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    results = []
    for case in CASES:
        results.append(time_case(*case, device=device))
        torch.cuda.empty_cache()
    print(f"device copy bandwidth: {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'B':>4} {'seq':>6} {'Hq':>3} {'Hkv':>3} {'D':>4} | "
          f"{'splits':>6} {'us':>8} {'GB/s':>6} {'%copy':>6} | "
          f"{'splits':>6} {'us':>8} {'GB/s':>6} {'%copy':>6}  (tight | max_seq_len 40960)")
    for r in results:
        cols = []
        for label in ("tight", "graph"):
            t = r[label]
            cols.append(f"{t['splits']:>6} {t['seconds'] * 1e6:>8.1f} "
                        f"{t['bytes_per_second'] / 1e9:>6.0f} "
                        f"{100 * t['bytes_per_second'] / copy:>5.1f}%")
        print(f"{r['batch']:>4} {r['seq_len']:>6} {r['num_heads']:>3} {r['num_kv_heads']:>3} "
              f"{r['head_dim']:>4} | {cols[0]} | {cols[1]}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "bench_decode_attention.json"
        path.write_text(json.dumps({"copy_bytes_per_second": copy, "page_size": PAGE_SIZE,
                                    "results": results}, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
