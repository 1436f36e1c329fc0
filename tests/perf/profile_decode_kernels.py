"""The GPU kernels of one batch-1 decode step, timed by torch's profiler, and
the graph replay time for each captured context bucket.

    python tests/perf/profile_decode_kernels.py [--shape qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import random

import torch
from torch.profiler import ProfilerActivity, profile

import protocol as p
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB, make_engine, random_model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    args = parser.parse_args()
    loaded = random_model(args.shape, torch.device("cuda"))
    core, _ = make_engine(loaded, max_concurrency=8, max_batched_tokens=2048, max_context=40960,
                          kv_capacity_tokens=65536)
    rng = random.Random(0)
    params = p.SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    core.handle(p.Generate("solo", [rng.randrange(QWEN3_TEXT_VOCAB) for _ in range(32)], params))
    for _ in range(8):
        core.step()
    graphs = core.runner.graphs
    assert graphs is not None
    for bucket in graphs.buckets:
        graph = graphs._graphs[(1, bucket)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            graph.replay()
        end.record()
        end.synchronize()
        print(f"graph replay, batch 1, context bucket {bucket}: "
              f"{start.elapsed_time(end) / 100 * 1e3:.0f} us")
    core.runner.graphs = None  # eager steps, so the profiler sees each kernel
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            core.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
