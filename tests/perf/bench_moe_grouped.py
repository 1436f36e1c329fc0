"""GPU timing of one MoE layer's experts: the grouped-GEMM path
(kernels.moe_grouped) against the torch loop (kernels.moe_reference), bf16.

    python tests/perf/bench_moe_grouped.py        (on the GPU machine; JSON to $OUT)

For Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes and T tokens routed at
random (softmax top-k of random logits), the device time per call: the grouped
path captured in a CUDA graph and replayed (median), the torch loop
eagerly (it reads the routing back to the host, so no graph can hold it).
"weight_gb_per_s" is the selected experts' weight bytes (each read once) over
the grouped time; "tflops" the useful GEMM work (2 * T * k * 3 * H * I) over it.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.moe_grouped import moe_experts_grouped  # noqa: E402
from kernels.moe_reference import moe_experts, route_topk  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
TOKENS = (16, 64, 256, 1024, 4096)
REPLAYS = 20


def graph_time_us(call: Callable[[], object]) -> float:
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return _median_us(graph.replay)


def eager_time_us(call: Callable[[], object]) -> float:
    call()
    return _median_us(call)


def _median_us(call: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench(name: str, hidden: int, size: int, experts: int, top_k: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(experts, 2 * size, hidden, device="cuda", generator=gen)
               / hidden**0.5).to(BF16)
    down = (torch.randn(experts, hidden, size, device="cuda", generator=gen) / size**0.5).to(BF16)
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(BF16)
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        weights, ids = route_topk(logits, top_k, normalize=True)
        weights = weights.to(BF16)
        args = (x, gate_up, down, ids, weights)
        grouped = partial(moe_experts_grouped, *args, silu_and_mul=silu_and_mul)
        grouped_us = graph_time_us(grouped)
        loop_us = eager_time_us(partial(moe_experts, *args))
        picked = int(torch.unique(ids).numel())
        weight_bytes = picked * 3 * hidden * size * 2
        got = grouped().double()
        want = moe_experts(*args).double()
        rows.append({
            "shape": name, "tokens": tokens, "experts_picked": picked,
            "grouped_us": grouped_us, "loop_us": loop_us,
            "speedup_vs_loop": loop_us / grouped_us,
            "weight_gb_per_s": weight_bytes / grouped_us * 1e-3,
            "tflops": 2 * tokens * top_k * 3 * hidden * size / grouped_us * 1e-6,
            "rel_diff_vs_loop": float((got - want).norm() / want.norm()),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    results = [row for name, shape in SHAPES.items() for row in bench(name, *shape)]
    out = Path(os.environ.get("OUT", ".")) / "bench_moe_grouped.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
