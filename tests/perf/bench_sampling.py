"""Times kernels.sampling.sample_tokens against torch on the GPU (not a test).

Sizes: N in {1, 64, 256} rows of V = 151936 (Qwen3) float32 logits; greedy rows
and sampled rows (the brief's top_k 50, top_p 0.9, min_p 0.05, temperature 0.7,
plus top-p alone and no filter). torch baselines in the same run: argmax for
greedy; for sampled rows the current sampler's sort-based path batched (divide,
sort, softmax, cumsum, masks, one multinomial for the batch: the engine's
per-row generator loop is slower still). Bytes counted: one read of the logits
(N * V * 4); the kernel reads them 1 (greedy, no filter), 2 (min-p only) or 3
(top-k / top-p) times, from L2 when the batch fits. Inputs rotate over >= 240 MB
so small batches are not timed out of L2. Median of CUDA-event timings.

    python tests/perf/bench_sampling.py       # writes $OUT/bench_sampling.json if OUT is set
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.reference import sampling_survivors
from kernels.sampling import sample_tokens

VOCAB = 151936
ROTATE_BYTES = 240 << 20
CONFIGS = {
    "greedy": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    "k50 p0.9 mp0.05 T0.7": {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
    "p0.9 T1.0": {"temperature": 1.0, "top_k": 0, "top_p": 0.9, "min_p": 0.0},
    "no filter T1.0": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
}


def time_ms(fn, calls: int, repeats: int) -> float:
    """Median over `repeats` of (events around `calls` calls) / calls, after warm-up."""
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    src = torch.randn(256 << 20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda _: dst.copy_(src), calls=5, repeats=10)
    return 2 * src.numel() * 4 / ms / 1e6


def torch_sample(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """engine/sampling/sampler.py's _draw, batched (one multinomial for all rows)."""
    vocab = logits.shape[1]
    scaled = logits / temperature.unsqueeze(1)
    ordered, order = scaled.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False
    picks = torch.multinomial(probs.masked_fill(drop, 0.0), 1)
    return order.gather(1, picks).squeeze(1)


def measure(name: str, values: dict, logits: list[torch.Tensor], seeds: torch.Tensor,
            offsets: torch.Tensor, copy_gbs: float) -> dict:
    """One (batch size, config) line: kernel and torch timings over rotating inputs."""
    rows, sets = logits[0].shape[0], len(logits)
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    temperature = torch.full((rows,), values["temperature"], device="cuda")
    top_k = torch.full((rows,), values["top_k"], dtype=torch.int32, device="cuda")
    top_p = torch.full((rows,), values["top_p"], device="cuda")
    min_p = torch.full((rows,), values["min_p"], device="cuda")
    filters = (temperature, top_k, top_p, min_p)
    sample_tokens(logits[0], *filters, seeds, offsets, out=out)
    keep = sampling_survivors(logits[0], *filters)
    assert bool(keep.gather(1, out[:, None]).all()), f"{name}: a token is not a survivor"

    def ours(i: int) -> None:
        sample_tokens(logits[i % sets], *filters, seeds, offsets, out=out)

    def theirs(i: int) -> None:
        x = logits[i % sets]
        x.argmax(dim=-1) if name == "greedy" else torch_sample(x, *filters)

    kernel_ms = time_ms(ours, calls=max(sets, 10), repeats=15)
    torch_ms = time_ms(theirs, calls=max(min(sets, 20), 3), repeats=5)
    gbs = rows * VOCAB * 4 / kernel_ms / 1e6
    return {
        "rows": rows, "vocab": VOCAB, "config": name, "kernel_us": kernel_ms * 1e3,
        "torch_us": torch_ms * 1e3, "speedup": torch_ms / kernel_ms,
        "kernel_GBps_one_read": gbs, "copy_GBps": copy_gbs,
    }


def main() -> None:
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    results = []
    for rows in (1, 64, 256):
        sets = max(1, -(-ROTATE_BYTES // (rows * VOCAB * 4)))
        # LLM-like logits: a bf16 projection's output (many exact ties), a long low tail.
        logits = [(torch.randn(rows, VOCAB, device="cuda") * 2.5).bfloat16().float()
                  for _ in range(sets)]
        seeds = torch.randint(0, 2**62, (rows,), device="cuda")
        offsets = torch.randint(0, 1000, (rows,), device="cuda")
        for name, values in CONFIGS.items():
            results.append(measure(name, values, logits, seeds, offsets, copy_gbs))
    print(f"{'N':>4} {'config':<22} {'kernel us':>10} {'torch us':>10} {'speedup':>8} "
          f"{'GB/s (1 read)':>14} {'of copy':>8}")
    for r in results:
        print(f"{r['rows']:>4} {r['config']:<22} {r['kernel_us']:>10.1f} {r['torch_us']:>10.1f} "
              f"{r['speedup']:>8.1f} {r['kernel_GBps_one_read']:>14.0f} "
              f"{r['kernel_GBps_one_read'] / copy_gbs:>8.0%}")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_sampling.json"
        path.write_text(json.dumps({"copy_GBps": copy_gbs, "results": results}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
