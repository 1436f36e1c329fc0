"""Host time against GPU time of decode steps and of mixed steps (decode rows
plus a new prompt), the steps a server runs while requests keep arriving.

    python tests/perf/profile_mixed_step.py [--shape qwen3-0.6b] [--rows 64] [--prompt 130]

Decode steps replay a CUDA graph; a step with a prompt chunk runs eagerly, one
kernel launch at a time. For each kind this prints the wall time per engine
step (the loop overlaps the host with the device, so it is the larger of the
two), the host time spent launching the forward pass, and the GPU time of the
same forward pass launched while the GPU was held back (so every kernel was
queued before the first ran: the GPU's own time, with no waiting on the host).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

import protocol as p
from engine.scheduling.core import EngineCore
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB, make_engine, random_model


def submit(core: EngineCore, rng: random.Random, request_id: str, prompt: int) -> None:
    params = p.SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    ids = [rng.randrange(QWEN3_TEXT_VOCAB) for _ in range(prompt)]
    core.handle(p.Generate(request_id, ids, params))


def timed_steps(core: EngineCore, steps: int, before_each: object = None) -> dict[str, float]:
    """Wall ms per step, and host ms inside runner.forward per step."""
    runner = core.runner
    forward = runner.forward
    host: list[float] = []

    def timed_forward(out):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        result = forward(out)
        host.append(time.perf_counter() - started)
        return result

    runner.forward = timed_forward  # type: ignore[method-assign]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        if callable(before_each):
            before_each()
        core.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps
    runner.forward = forward  # type: ignore[method-assign]
    return {"wall_ms": wall * 1e3, "host_forward_ms": statistics.median(host) * 1e3}


def gpu_only_ms(core: EngineCore) -> float:
    """GPU ms of the next scheduled step's forward pass, all of it queued
    behind a sleep kernel first. The step is scheduled and run for real."""
    out = core.scheduler.schedule()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s at H200 clocks: time to queue everything
    start.record()
    forward = core.runner.forward(out)
    end.record()
    end.synchronize()
    slot = core.runner.future.next_slots()
    tokens = core.runner.sample(forward, slot)
    core.scheduler.add_pending_tokens(out, slot)
    core.scheduler.complete(out, tokens.tolist())
    return start.elapsed_time(end)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, default=64, help="decoding requests")
    parser.add_argument("--prompt", type=int, default=130, help="tokens of each new prompt")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    loaded = random_model(args.shape, torch.device("cuda"))
    lanes = args.rows + 2 * args.steps + 8
    core, _ = make_engine(loaded, max_concurrency=lanes, max_batched_tokens=8192,
                          max_context=8192)
    rng = random.Random(0)
    for index in range(args.rows):
        submit(core, rng, f"d{index}", args.prompt)
    while core.scheduler.num_prefilling or core.scheduler.waiting:
        core.step()
    for _ in range(10):
        core.step()
    decode = timed_steps(core, args.steps)
    counter = iter(range(10**6))
    mixed = timed_steps(core, args.steps,
                        lambda: submit(core, rng, f"m{next(counter)}", args.prompt))
    # Completes the step in flight, so the next schedule is the whole story.
    core._drain()
    submit(core, rng, "g-mixed", args.prompt)
    mixed["gpu_ms"] = gpu_only_ms(core)
    decode["gpu_ms"] = gpu_only_ms(core)
    result = {"shape": args.shape, "decoding_rows": args.rows, "prompt_tokens": args.prompt,
              "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "decode": decode, "mixed": mixed}
    print(json.dumps(result, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, "profile_mixed_step.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
