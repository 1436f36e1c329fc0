"""Where the wall time of nano-vllm's workload goes: the host's own work, or
waiting for the GPU.

    python tests/perf/profile_throughput.py [--shape qwen3-0.6b]

The workload of bench_gpu_engine.py's throughput figure (256 requests, input
and output lengths uniform in 100..1024, seed 0). The engine's loop waits for
the GPU only when it takes a step's tokens (SampledTokens.tolist); all the
rest of a turn is host work. Much waiting means the GPU sets the pace; little
waiting means the host does, and host work is what to cut. Also splits the
steps into prefill-only, mixed and decode by their wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

import protocol as p
from engine.execution import model_runner
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB, make_engine, random_model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    args = parser.parse_args()
    loaded = random_model(args.shape, torch.device("cuda"))
    core, _ = make_engine(loaded, max_concurrency=256, max_batched_tokens=16384,
                          max_context=4096)
    waited = [0.0]
    tolist = model_runner.SampledTokens.tolist

    def timed_tolist(self: model_runner.SampledTokens) -> list[int]:
        started = time.perf_counter()
        tokens = tolist(self)
        waited[0] += time.perf_counter() - started
        return tokens

    model_runner.SampledTokens.tolist = timed_tolist  # type: ignore[method-assign]
    rng = random.Random(0)
    params = p.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    core.handle(p.Generate("warm", [rng.randrange(QWEN3_TEXT_VOCAB) for _ in range(256)], params))
    while core.has_work:
        core.step()
    rng = random.Random(0)
    workload = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
    for index, (prompt_len, out_len) in enumerate(workload):
        prompt = [rng.randrange(QWEN3_TEXT_VOCAB) for _ in range(prompt_len)]
        core.handle(p.Generate(f"r{index}", prompt,
                               p.SamplingParams(max_tokens=out_len, temperature=0.0,
                                                ignore_eos=True)))
    waited[0] = 0.0
    kinds: dict[str, list[float]] = {"prefill": [], "mixed": [], "decode": []}
    started = time.perf_counter()
    while core.has_work:
        prefilling = core.scheduler.num_prefilling or core.scheduler.waiting
        decoding = any(not seq.is_prefilling for seq in core.scheduler.running)
        kind = ("mixed" if decoding else "prefill") if prefilling else "decode"
        turn = time.perf_counter()
        core.step()
        kinds[kind].append(time.perf_counter() - turn)
    seconds = time.perf_counter() - started
    output_tokens = sum(out for _, out in workload)
    result = {
        "shape": args.shape, "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(), "seconds": seconds,
        "output_tok_s": output_tokens / seconds, "waiting_for_gpu_s": waited[0],
        "host_s": seconds - waited[0],
        "turns": {kind: {"count": len(times), "seconds": sum(times),
                         "mean_ms": 1e3 * sum(times) / len(times) if times else 0.0}
                  for kind, times in kinds.items()},
    }
    print(json.dumps(result, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, "profile_throughput.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
