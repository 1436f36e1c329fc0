"""What log probabilities and prompt scoring cost the engine, each measured
against the same work without them in one run (random weights, real shapes).

    python tests/perf/bench_gpu_scores.py [--only logprobs,scoring] [--smoke]

1. 64 streams (256-token prompts, 512 generated tokens each) asking for the
   sampled token's log probability and its 20 most likely alternatives
   (OpenAI's top_logprobs: 20), against the same 64 streams asking for
   nothing: output tok/s of each, rounds alternated so drift hits both.
2. Prompt scoring (max_tokens 0 with prompt_logprobs 0: lm-eval's
   loglikelihood) of 256 prompts of 1k tokens at the 0.6B and 8B shapes,
   against a plain prefill of the same prompts (max_tokens 1): prompt tok/s.

--smoke runs both on the CPU at a tiny shape in seconds (tests/test_perf_smoke.py)
so the script cannot rot. Writes every figure to $OUT/bench_gpu_scores.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import protocol as p
from engine.scheduling.core import EngineCore
from tests.perf.gpu_models import make_engine, random_model


class Setup:
    """Where and at which sizes the benchmark runs."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.streams, self.prompt_len, self.output_len = (4, 16, 8) if smoke else (64, 256, 512)
        self.rounds = 1 if smoke else 3
        self.prompts, self.score_len = (4, 64) if smoke else (256, 1024)
        self.shapes = ["tiny"] if smoke else ["qwen3-0.6b", "qwen3-8b"]
        self.vocab = 1000 if smoke else 151669

    def engine(self, shape: str, **options: Any) -> tuple[EngineCore, Any]:
        loaded = random_model(shape, self.device, dtype=self.dtype)
        core, _ = make_engine(loaded, device=self.device.type,
                              dtype="float32" if self.smoke else "bfloat16", **options)
        return core, loaded

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _drain(core: EngineCore) -> None:
    while core.has_work:
        core.step()


def _timed(setup: Setup, core: EngineCore, submit: Callable[[], None]) -> float:
    setup.sync()
    started = time.perf_counter()
    submit()
    _drain(core)
    setup.sync()
    return time.perf_counter() - started


def bench_logprobs(setup: Setup) -> dict[str, Any]:
    core, _ = setup.engine(setup.shapes[0], max_concurrency=setup.streams,
                                max_batched_tokens=16384, max_context=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(setup.vocab) for _ in range(setup.prompt_len)]
               for _ in range(setup.streams)]

    def submit(tag: str, logprobs: int) -> Callable[[], None]:
        def go() -> None:
            for index, prompt in enumerate(prompts):
                params = p.SamplingParams(max_tokens=setup.output_len, temperature=0.0,
                                          ignore_eos=True, logprobs=logprobs)
                core.handle(p.Generate(f"{tag}-{index}", prompt, params))
        return go

    _timed(setup, core, submit("warm", 20))
    seconds: dict[str, list[float]] = {"plain": [], "top20": []}
    for round_index in range(setup.rounds):
        seconds["plain"].append(_timed(setup, core, submit(f"plain{round_index}", -1)))
        seconds["top20"].append(_timed(setup, core, submit(f"top{round_index}", 20)))
    tokens = setup.streams * setup.output_len
    plain = tokens / min(seconds["plain"])
    top20 = tokens / min(seconds["top20"])
    return {"streams": setup.streams, "output_tokens": tokens, "plain_tok_s": plain,
            "top_logprobs_20_tok_s": top20, "cost": 1 - top20 / plain, "seconds": seconds}


def bench_scoring(setup: Setup, shape: str) -> dict[str, Any]:
    core, _ = setup.engine(shape, max_concurrency=64, max_batched_tokens=8192,
                                max_context=4096)
    rng = random.Random(1)
    prompts = [[rng.randrange(setup.vocab) for _ in range(setup.score_len)]
               for _ in range(setup.prompts)]

    def submit(tag: str, scored: bool, first_token: int) -> Callable[[], None]:
        def go() -> None:
            for index, prompt in enumerate(prompts):
                params = p.SamplingParams(max_tokens=0 if scored else 1, temperature=0.0,
                                          ignore_eos=True, prompt_logprobs=0 if scored else -1)
                # A first token of the round's own keeps the prefix cache out of it.
                core.handle(p.Generate(f"{tag}-{index}", [first_token, *prompt[1:]], params))
        return go

    _timed(setup, core, submit("warm", True, 0))
    seconds: dict[str, float] = {}
    for first_token, (tag, scored) in enumerate((("prefill", False), ("scoring", True)), 1):
        seconds[tag] = _timed(setup, core, submit(tag, scored, first_token))
    tokens = setup.prompts * setup.score_len
    return {"prompts": setup.prompts, "prompt_tokens": tokens,
            "prefill_tok_s": tokens / seconds["prefill"],
            "scoring_tok_s": tokens / seconds["scoring"],
            "scoring_over_prefill": seconds["prefill"] / seconds["scoring"]}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="logprobs,scoring")
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    setup = Setup(args.smoke)
    wanted = set(args.only.split(","))
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"),
                               "device": "cpu" if args.smoke else torch.cuda.get_device_name()}
    if "logprobs" in wanted:
        results["logprobs"] = bench_logprobs(setup)
        _free()
        print("logprobs", json.dumps(results["logprobs"]), flush=True)
    if "scoring" in wanted:
        results["scoring"] = {}
        for shape in setup.shapes:
            results["scoring"][shape] = bench_scoring(setup, shape)
            _free()
        print("scoring", json.dumps(results["scoring"]), flush=True)
    out = Path(os.environ.get("OUT", "."))
    if not args.smoke:
        (out / "bench_gpu_scores.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
