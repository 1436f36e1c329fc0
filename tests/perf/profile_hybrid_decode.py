"""Where the GPU time of a hybrid model's batch-1 decode step goes, kernel by
kernel: random weights at the Qwen3.5-35B-A3B shape (tests/perf/bench_gpu_hybrid.py),
cut to --layers layers, decode steps run eagerly (the kernels a graph would
replay) under torch.profiler.

    python tests/perf/profile_hybrid_decode.py [--layers 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import random

import torch
from torch.profiler import ProfilerActivity, profile

import protocol as p
from tests.perf.bench_gpu_hybrid import QWEN3_5_35B_A3B, hybrid_model
from tests.perf.gpu_models import make_engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    cfg = {**QWEN3_5_35B_A3B, "num_hidden_layers": args.layers}
    loaded = hybrid_model(cfg, torch.device("cuda"), torch.bfloat16)
    core, _ = make_engine(loaded, max_concurrency=1, max_batched_tokens=512, max_context=2048,
                          cuda_graph=False, ctx_checkpoints=0)
    rng = random.Random(0)
    params = p.SamplingParams(max_tokens=args.steps + 40, temperature=0.0, ignore_eos=True)
    core.handle(p.Generate("solo", [rng.randrange(150000) for _ in range(128)], params))
    for _ in range(10):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events)
    print(f"{args.layers} layers, {args.steps} steps: {total / args.steps / 1000:.3f} ms of "
          f"kernels a step, {sum(e.count for e in events) / args.steps:.0f} kernels a step")
    for event in sorted(events, key=lambda e: -e.device_time_total)[: args.top]:
        share = event.device_time_total / total
        print(f"{event.device_time_total / args.steps:9.1f} us/step {share:6.1%} "
              f"x{event.count // args.steps:<4d} {event.key[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
