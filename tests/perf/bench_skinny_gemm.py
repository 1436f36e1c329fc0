"""GPU timing of kernels.skinny_gemm.skinny_linear against F.linear (cuBLAS).

    python tests/perf/bench_skinny_gemm.py        (on the GPU machine; JSON to $OUT)

For M = 1, 2, 4, 8 rows and the decode projections of Qwen3-0.6B and
Qwen3-8B, the device time per call: CALLS_PER_GRAPH calls captured in one
CUDA graph and replayed (median of the replays, divided by the calls), so
host launch cost stays out; the calls rotate over enough weight copies that
one pass over them is at least twice the 60 MB L2, so the weight comes from
HBM as in a real decode step (where the whole model is far larger than L2).
Achieved bandwidth is the bytes the op must move (weight + x read once, out
written once) over that time, set against a 1 GiB device copy (bytes read +
written). Graph replays include the small gap between consecutive kernels,
for both columns alike. "diff" is the relative difference between our output
and cuBLAS's (both bf16; a few 1e-3 is bf16 rounding).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels.skinny_gemm import skinny_linear  # noqa: E402
from tests.perf import gpu_models  # noqa: E402

L2_BYTES = 60 * 2**20
ROWS = (1, 2, 4, 8)
# name: (N, K) of weight [N, K]
SHAPES = {
    "0.6B qkv": (4096, 1024),
    "0.6B o_proj": (1024, 2048),
    "0.6B gate_up": (6144, 1024),
    "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096),
    "8B o_proj": (4096, 4096),
    "8B gate_up": (24576, 4096),
    "8B down": (4096, 12288),
}
CALLS_PER_GRAPH = 32
REPLAYS = 20
MAX_COPIES = 32
BF16 = torch.bfloat16


def graph_time_us(calls: list[Callable[[], object]]) -> float:
    """Median device time of one call, from replays of a graph of all the calls."""
    return gpu_models.graph_time_us(calls, replays=REPLAYS, warm_replays=1)


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy."""
    src = torch.randn(2**29, device="cuda", dtype=BF16)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * src.numel() * src.element_size() / statistics.median(times[2:])


def bench_shape(name: str, n: int, k: int) -> list[dict]:
    weight_bytes = n * k * 2
    copies = max(1, min(MAX_COPIES, -(-2 * L2_BYTES // weight_bytes)))
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(BF16) for _ in range(copies)]
    rows_out = []
    for rows in ROWS:
        xs = [torch.randn(rows, k, device="cuda").to(BF16) for _ in range(copies)]
        outs = [torch.empty(rows, n, device="cuda", dtype=BF16) for _ in range(copies)]
        order = [i % copies for i in range(CALLS_PER_GRAPH)]
        ours = [partial(skinny_linear, xs[i], weights[i], out=outs[i]) for i in order]
        cublas = [partial(F.linear, xs[i], weights[i]) for i in order]
        ours_us = graph_time_us(ours)
        cublas_us = graph_time_us(cublas)
        ref = F.linear(xs[0], weights[0]).double()
        diff = float((skinny_linear(xs[0], weights[0]).double() - ref).norm() / ref.norm())
        nbytes = weight_bytes + rows * k * 2 + rows * n * 2
        rows_out.append({
            "shape": name, "n": n, "k": k, "rows": rows, "bytes": nbytes,
            "weight_copies": copies, "kernel_us": ours_us, "cublas_us": cublas_us,
            "gb_per_s": nbytes / ours_us * 1e-3, "cublas_gb_per_s": nbytes / cublas_us * 1e-3,
            "speedup": cublas_us / ours_us, "rel_diff_vs_cublas": diff,
        })
    return rows_out


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    copy_gb = copy_bandwidth() * 1e-9
    rows: list[dict] = []
    for name, (n, k) in SHAPES.items():
        rows.extend(bench_shape(name, n, k))
        torch.cuda.empty_cache()
    print(f"device copy: {copy_gb:.0f} GB/s (read + written) on {torch.cuda.get_device_name()}")
    print(f"{'shape':<13}{'N x K':>13}{'M':>3}{'ours us':>9}{'GB/s':>7}{'% copy':>8}"
          f"{'cuBLAS us':>11}{'GB/s':>7}{'speedup':>9}{'diff':>9}")
    for row in rows:
        row["fraction_of_copy"] = row["gb_per_s"] / copy_gb
        row["cublas_fraction_of_copy"] = row["cublas_gb_per_s"] / copy_gb
        print(f"{row['shape']:<13}{row['n']:>6} x{row['k']:>6}{row['rows']:>3}"
              f"{row['kernel_us']:>9.2f}{row['gb_per_s']:>7.0f}{100 * row['fraction_of_copy']:>7.0f}%"
              f"{row['cublas_us']:>11.2f}{row['cublas_gb_per_s']:>7.0f}{row['speedup']:>8.2f}x"
              f"{row['rel_diff_vs_cublas']:>9.1e}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        result = {"device": torch.cuda.get_device_name(), "copy_gb_per_s": copy_gb, "rows": rows}
        (Path(out_dir) / "bench_skinny_gemm.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
