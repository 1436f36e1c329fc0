"""Where the host time of a batch-1 decode step goes (cProfile), against the
GPU time of the step's graph replay alone.

    python tests/perf/profile_decode_step.py [--shape qwen3-0.6b] [--steps 300]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch

import protocol as p
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB, make_engine, random_model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    loaded = random_model(args.shape, torch.device("cuda"))
    core, _ = make_engine(loaded, max_concurrency=8, max_batched_tokens=2048, max_context=4096,
                          kv_capacity_tokens=65536)
    rng = random.Random(0)
    params = p.SamplingParams(max_tokens=args.steps + 50, temperature=0.0, ignore_eos=True)
    core.handle(p.Generate("solo", [rng.randrange(QWEN3_TEXT_VOCAB) for _ in range(32)], params))
    for _ in range(20):
        core.step()
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(args.steps):
        core.step()
    profiler.disable()
    step_ms = (time.perf_counter() - started) / args.steps * 1e3
    graphs = core.runner.graphs
    assert graphs is not None
    graph = graphs._graphs[(1, graphs.buckets[0])]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / 100
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)
    print(text.getvalue())
    print(f"{args.shape}: {step_ms:.3f} ms per engine step under cProfile; graph replay alone "
          f"{replay_ms:.3f} ms of GPU time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
