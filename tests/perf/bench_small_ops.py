"""GPU timing of the small memory-bound ops: rms_norm, add_rms_norm, rope_and_cache.

    python tests/perf/bench_small_ops.py        (on the GPU machine; JSON to $OUT)

Each op runs at T = 1, 256 and 8192 tokens: RMSNorm at H = 1024 and 4096,
rope_and_cache with Qwen3-0.6B's attention (Hq 16, Hkv 8, D 128, q/k norm).
Times are device times per call: many calls captured in one CUDA graph and
replayed (median of the replays, divided by the calls), so launch overhead
and host time stay out; inputs rotate over enough sets to exceed the 60 MB
L2. Achieved bandwidth is the bytes the op must move (each input read once,
each output written once) over that time, set against a large device copy
(bytes read + written). The torch reference ops (kernels.reference) are timed
the same way for the same sizes; "eager" is the wall time per call of our op
launched from Python in a loop (host launch cost included).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels import reference  # noqa: E402
from kernels.norm import add_rms_norm, rms_norm  # noqa: E402
from kernels.rope_cache import rope_and_cache  # noqa: E402
from tests.perf import gpu_models  # noqa: E402

L2_BYTES = 60 * 2**20
TOKENS = (1, 256, 8192)
HIDDEN = (1024, 4096)
EPS = 1e-6
# Qwen3-0.6B attention
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
MAX_POSITIONS = 40960
PAGE_SIZE = 16
CALLS_PER_GRAPH = 32
REPLAYS = 25
BF16 = torch.bfloat16


def input_sets(bytes_per_call: int) -> int:
    """How many input sets to rotate so that one pass over them is 2x the L2."""
    return max(1, min(CALLS_PER_GRAPH, -(-2 * L2_BYTES // bytes_per_call)))


def graph_time_us(calls: list[Callable[[], object]]) -> float:
    """Median device time of one call, from replays of a graph of all the calls."""
    return gpu_models.graph_time_us(calls, replays=REPLAYS, warm_replays=1)


def eager_time_us(call: Callable[[], object], iterations: int = 200) -> float:
    """Wall time per call launched from Python, host launch cost included."""
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iterations


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


def norm_case(name: str, tokens: int, hidden: int) -> tuple[int, list, list]:
    """(bytes per call, our calls, reference calls) over rotating input sets."""
    weight = (1 + 0.5 * torch.randn(hidden, device="cuda")).to(BF16)
    tensors_per_call = 2 if name == "rms_norm" else 4
    nbytes = tensors_per_call * tokens * hidden * 2 + hidden * 2
    sets = input_sets(nbytes)
    xs = [torch.randn(tokens, hidden, device="cuda").to(BF16) for _ in range(sets)]
    residuals = [torch.randn_like(x) for x in xs]
    outs = [torch.empty_like(x) for x in xs]
    if name == "rms_norm":
        ours = [lambda i=i: rms_norm(xs[i], weight, EPS, out=outs[i]) for i in range(sets)]
        refs = [lambda i=i: reference.rms_norm(xs[i], weight, EPS) for i in range(sets)]
    else:
        ours = [lambda i=i: add_rms_norm(xs[i], residuals[i], weight, EPS, out=outs[i])
                for i in range(sets)]
        refs = [lambda i=i: reference.add_rms_norm(xs[i], residuals[i], weight, EPS)
                for i in range(sets)]
    return nbytes, ours, refs


def rope_case(tokens: int) -> tuple[int, list, list]:
    """(bytes per call, our calls, reference calls) over rotating input sets."""
    cos_sin = reference.build_rope_cache(HEAD_DIM, MAX_POSITIONS, 1e6, None, "cuda", BF16)
    q_weight = (1 + 0.5 * torch.randn(HEAD_DIM, device="cuda")).to(BF16)
    k_weight = (1 + 0.5 * torch.randn(HEAD_DIM, device="cuda")).to(BF16)
    heads = NUM_HEADS + 2 * NUM_KV_HEADS
    # qkv read; q, k, v written; cos/sin rows, positions and slots read.
    nbytes = 2 * tokens * heads * HEAD_DIM * 2 + tokens * (HEAD_DIM * 2 + 16)
    sets = input_sets(nbytes)
    pages = -(-tokens // PAGE_SIZE) * 2
    shape = (pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda").to(BF16)
    v_cache = torch.randn(shape, device="cuda").to(BF16)
    qkvs = [torch.randn(tokens, heads * HEAD_DIM, device="cuda").to(BF16) for _ in range(sets)]
    positions = [torch.randint(0, MAX_POSITIONS, (tokens,), device="cuda") for _ in range(sets)]
    slots = [torch.randperm(pages * PAGE_SIZE, device="cuda")[:tokens] for _ in range(sets)]
    q_outs = [torch.empty(tokens, NUM_HEADS, HEAD_DIM, device="cuda", dtype=BF16)
              for _ in range(sets)]

    def ours(i: int) -> None:
        rope_and_cache(qkvs[i], positions[i], cos_sin, k_cache, v_cache, slots[i], NUM_HEADS,
                       NUM_KV_HEADS, q_weight, k_weight, EPS, q_out=q_outs[i])

    def ref(i: int) -> None:
        q_width, kv_width = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        q, k, v = qkvs[i].split([q_width, kv_width, kv_width], dim=-1)
        q = reference.rms_norm(q.view(tokens, NUM_HEADS, HEAD_DIM), q_weight, EPS)
        k = reference.rms_norm(k.view(tokens, NUM_KV_HEADS, HEAD_DIM), k_weight, EPS)
        q, k = reference.apply_rope(positions[i], q, k, cos_sin)
        reference.write_kv_cache(k, v.view(tokens, NUM_KV_HEADS, HEAD_DIM), k_cache, v_cache,
                                 slots[i])

    return nbytes, [lambda i=i: ours(i) for i in range(sets)], [lambda i=i: ref(i)
                                                                 for i in range(sets)]


def measure(op: str, tokens: int, shape: str, nbytes: int, ours: list, refs: list) -> dict:
    # Graphs of CALLS_PER_GRAPH calls cycling over the input sets.
    repeat = -(-CALLS_PER_GRAPH // len(ours))
    kernel_us = graph_time_us((ours * repeat)[:CALLS_PER_GRAPH])
    ref_us = graph_time_us((refs * repeat)[:CALLS_PER_GRAPH])
    return {
        "op": op, "tokens": tokens, "shape": shape, "bytes": nbytes, "input_sets": len(ours),
        "kernel_us": kernel_us, "gb_per_s": nbytes / kernel_us * 1e-3,
        "reference_us": ref_us, "eager_us": eager_time_us(ours[0]),
    }


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    copy_bytes_per_s = copy_bandwidth()
    rows: list[dict] = []
    for hidden in HIDDEN:
        for tokens in TOKENS:
            for name in ("rms_norm", "add_rms_norm"):
                rows.append(measure(name, tokens, f"H={hidden}", *norm_case(name, tokens, hidden)))
                torch.cuda.empty_cache()
    for tokens in TOKENS:
        shape = f"{NUM_HEADS}/{NUM_KV_HEADS}x{HEAD_DIM}+qk_norm"
        rows.append(measure("rope_and_cache", tokens, shape, *rope_case(tokens)))
        torch.cuda.empty_cache()
    copy_gb = copy_bytes_per_s * 1e-9
    print(f"device copy: {copy_gb:.0f} GB/s (read + written) on {torch.cuda.get_device_name()}")
    header = (f"{'op':<15}{'T':>6} {'shape':<22}{'kernel us':>10}{'GB/s':>8}{'% copy':>8}"
              f"{'torch us':>10}{'speedup':>9}{'eager us':>10}")
    print(header)
    for row in rows:
        row["fraction_of_copy"] = row["gb_per_s"] / copy_gb
        print(f"{row['op']:<15}{row['tokens']:>6} {row['shape']:<22}{row['kernel_us']:>10.2f}"
              f"{row['gb_per_s']:>8.0f}{100 * row['fraction_of_copy']:>7.0f}%"
              f"{row['reference_us']:>10.2f}{row['reference_us'] / row['kernel_us']:>8.1f}x"
              f"{row['eager_us']:>10.2f}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        result = {"device": torch.cuda.get_device_name(), "copy_gb_per_s": copy_gb, "rows": rows}
        (Path(out_dir) / "bench_small_ops.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
