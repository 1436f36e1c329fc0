"""GPU timing of kernels.moe.moe_experts_gemv (the decode expert MLP) against
torch._grouped_mm and the torch reference, at Qwen3-30B-A3B's expert shape.

    python tests/perf/bench_gpu_moe.py          (on the GPU machine; JSON to $OUT)
    python tests/perf/bench_gpu_moe.py --smoke  (CPU, tiny, seconds: the
                                                 reference paths only)

One MoE layer's stacks (E = 128 experts, k = 8, H = 2048, I = 768), copied
LAYERS times so consecutive calls read different weights, at T = 1..64
tokens. Each timed call gets its own random routing (k distinct experts per
token, normalized weights), rotating over CALLS of them, so the selected
experts mostly come from HBM as in a real decode step. Device time per call:
for the kernel and the grouped GEMM, CALLS calls captured in one CUDA graph
and replayed (median over replays, divided by CALLS); the reference reads
the routing back to the host, so it runs eagerly between CUDA events.

Effective bandwidth = bytes of the distinct experts each call selects (gate_up
and down rows, read once) / time, set against a 1 GiB device-to-device copy
(bytes read + written) measured in the same run. The grouped path sorts the
(token, slot) pairs by expert on the device (stable argsort, a device
histogram's cumulative sum as the group ends), gathers the rows, runs two
torch._grouped_mm calls with torch's SiLU between, and adds the weighted rows
back with index_add_; it reads the same distinct experts. "diff" is the
relative difference of the kernel's output from the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels import moe_reference  # noqa: E402
from tests.perf import gpu_models  # noqa: E402
from tests.perf.gpu_models import copy_bandwidth  # noqa: E402

# Qwen3-30B-A3B: (experts, top_k, hidden, intermediate) of one layer.
FULL_SHAPE = (128, 8, 2048, 768)
SMOKE_SHAPE = (8, 2, 64, 32)
FULL_TOKENS = (1, 2, 4, 8, 16, 32, 64)
SMOKE_TOKENS = (1, 4)
LAYERS = 4  # 4.8 GB of stacks: far past the 50-60 MB L2
CALLS = 16
REPLAYS = 30
BF16 = torch.bfloat16


class Layer:
    """One layer's expert stacks, random at Linear-init scale."""

    def __init__(self, shape: tuple[int, int, int, int], device: torch.device,
                 dtype: torch.dtype, seed: int) -> None:
        experts, _, hidden, size = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        self.gate_up = (torch.randn(experts, 2 * size, hidden, device=device, generator=gen)
                        / hidden**0.5).to(dtype)
        self.down = (torch.randn(experts, hidden, size, device=device, generator=gen)
                     / size**0.5).to(dtype)


class Call:
    """One routed call's inputs: hidden [T, H], ids int32 [T, k], weights float32 [T, k]."""

    def __init__(self, tokens: int, shape: tuple[int, int, int, int], device: torch.device,
                 dtype: torch.dtype, seed: int) -> None:
        experts, top_k, hidden, size = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        self.hidden = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
        logits = torch.randn(tokens, experts, device=device, generator=gen)
        weights, ids = moe_reference.route_topk(logits, top_k, normalize=True)
        self.weights = weights.contiguous()
        self.ids = ids.int().contiguous()
        self.ids64 = ids
        distinct = int(ids.unique().numel())
        self.expert_bytes = distinct * 3 * size * hidden * torch.finfo(dtype).bits // 8
        self.out = torch.empty(tokens, hidden, device=device, dtype=dtype)


def grouped_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe_experts through torch._grouped_mm, with no host sync (graph-safe)."""
    num_experts, top_k = gate_up.shape[0], ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=hidden.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0).to(torch.int32)
    tokens = order // top_k
    rows = hidden.index_select(0, tokens)
    gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=1)
    act = F.silu(gate) * up
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=ends)
    contribution = (y * weights.reshape(-1)[order, None]).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add_(0, tokens, contribution)


def graph_time_us(calls: list[Callable[[], object]]) -> float:
    """Median device time of one call, from replays of a graph of all the calls."""
    return gpu_models.graph_time_us(calls, replays=REPLAYS, warm_replays=3)


def eager_time_us(calls: list[Callable[[], object]], cuda: bool) -> float:
    """Median time of one call, running all of them back to back, many times."""
    for call in calls:
        call()
    if not cuda:
        times = []
        for _ in range(3):
            begin = time.perf_counter()
            for call in calls:
                call()
            times.append(time.perf_counter() - begin)
        return statistics.median(times) * 1e6 / len(calls)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(max(3, REPLAYS // 3)):
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / len(calls)


def relative_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def bench_tokens(tokens: int, layers: list[Layer], shape: tuple[int, int, int, int],
                 smoke: bool) -> dict:
    device = layers[0].gate_up.device
    dtype = layers[0].gate_up.dtype
    calls = [Call(tokens, shape, device, dtype, seed=1000 * tokens + i)
             for i in range(2 if smoke else CALLS)]
    # (call, layer) pairs: consecutive calls read different layers' stacks.
    work = [(call, layers[i % len(layers)]) for i, call in enumerate(calls)]
    expert_bytes = sum(call.expert_bytes for call in calls) / len(calls)
    row: dict = {"tokens": tokens, "distinct_expert_bytes": expert_bytes}

    def reference(call: Call, layer: Layer) -> Callable[[], object]:
        return lambda: moe_reference.moe_experts(call.hidden, layer.gate_up, layer.down,
                                                 call.ids64, call.weights)

    def grouped(call: Call, layer: Layer) -> Callable[[], object]:
        return lambda: grouped_experts(call.hidden, layer.gate_up, layer.down, call.ids,
                                       call.weights)

    first, first_layer = work[0]
    ref = moe_reference.moe_experts(first.hidden, first_layer.gate_up, first_layer.down,
                                    first.ids64, first.weights)
    row["reference_us"] = eager_time_us([reference(c, la) for c, la in work],
                                        cuda=not smoke)
    row["grouped_diff"] = relative_diff(grouped(first, first_layer)(), ref)
    if smoke:
        row["grouped_us"] = eager_time_us([grouped(c, la) for c, la in work],
                                          cuda=False)
        return row

    from kernels.moe import moe_experts_gemv, moe_gemv_workspace

    _, top_k, _, size = shape
    workspace = moe_gemv_workspace(tokens * top_k, size, device)

    def kernel(call: Call, layer: Layer) -> Callable[[], object]:
        return lambda: moe_experts_gemv(call.hidden, layer.gate_up, layer.down, call.ids,
                                        call.weights, out=call.out, workspace=workspace)

    row["kernel_us"] = graph_time_us([kernel(c, la) for c, la in work])
    kernel(first, first_layer)()
    row["kernel_diff"] = relative_diff(first.out, ref)
    try:
        row["grouped_us"] = graph_time_us([grouped(c, la) for c, la in work])
        row["grouped_timing"] = "graph"
    except RuntimeError as error:  # a capture the grouped path cannot take part in
        torch.cuda.synchronize()
        row["grouped_us"] = eager_time_us([grouped(c, la) for c, la in work], True)
        row["grouped_timing"] = f"eager ({str(error).splitlines()[0][:80]})"
    for name in ("kernel", "grouped", "reference"):
        row[f"{name}_gb_per_s"] = expert_bytes / row[f"{name}_us"] * 1e-3
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = SMOKE_SHAPE if args.smoke else FULL_SHAPE
    token_counts = SMOKE_TOKENS if args.smoke else FULL_TOKENS
    layers = [Layer(shape, device, BF16, seed=layer) for layer in range(1 if args.smoke else LAYERS)]
    copy_gb = 0.0 if args.smoke else copy_bandwidth(torch.device("cuda")) * 1e-9
    rows = []
    for tokens in token_counts:
        rows.append(bench_tokens(tokens, layers, shape, args.smoke))
    experts, top_k, hidden, size = shape
    where = "CPU smoke" if args.smoke else torch.cuda.get_device_name()
    print(f"MoE experts E={experts} k={top_k} H={hidden} I={size} on {where}"
          + (f"; device copy {copy_gb:.0f} GB/s (read + written)" if copy_gb else ""))
    if args.smoke:
        print(f"{'T':>3}{'MB experts':>12}{'reference us':>14}{'grouped us':>12}{'diff':>9}")
        for row in rows:
            print(f"{row['tokens']:>3}{row['distinct_expert_bytes'] / 1e6:>12.2f}"
                  f"{row['reference_us']:>14.0f}{row['grouped_us']:>12.0f}{row['grouped_diff']:>9.1e}")
            if row["grouped_diff"] > 2e-2:
                sys.exit(f"grouped path disagrees with the reference at T={row['tokens']}")
    else:
        print(f"{'T':>3}{'MB experts':>12}{'kernel us':>11}{'GB/s':>7}{'% copy':>8}"
              f"{'grouped us':>12}{'GB/s':>7}{'reference us':>14}{'GB/s':>7}{'diff':>9}")
        for row in rows:
            row["kernel_fraction_of_copy"] = row["kernel_gb_per_s"] / copy_gb
            row["grouped_fraction_of_copy"] = row["grouped_gb_per_s"] / copy_gb
            print(f"{row['tokens']:>3}{row['distinct_expert_bytes'] / 1e6:>12.1f}"
                  f"{row['kernel_us']:>11.1f}{row['kernel_gb_per_s']:>7.0f}"
                  f"{100 * row['kernel_fraction_of_copy']:>7.0f}%"
                  f"{row['grouped_us']:>12.1f}{row['grouped_gb_per_s']:>7.0f}"
                  f"{row['reference_us']:>14.1f}{row['reference_gb_per_s']:>7.0f}"
                  f"{row['kernel_diff']:>9.1e}")
    out_dir = os.environ.get("OUT")
    if out_dir and not args.smoke:
        result = {"device": where, "shape": dict(zip(("experts", "top_k", "hidden", "intermediate"),
                                                     shape, strict=True)),
                  "copy_gb_per_s": copy_gb, "layers": LAYERS, "calls_per_graph": CALLS,
                  "rows": rows}
        (Path(out_dir) / "bench_gpu_moe.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
