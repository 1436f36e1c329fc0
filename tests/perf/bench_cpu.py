"""CPU benchmark: SmolLM2-135M decode and prefill, Roundhouse against Hugging
Face transformers in one run, and the router's added latency per request.

    .venv/bin/python tests/perf/bench_cpu.py [--threads N] [--json out.json]
    .venv/bin/python tests/perf/bench_cpu.py --smoke     # seconds: tiny model, one round

--smoke checks that the benchmark still runs (tests/test_perf_smoke.py runs
it): a tiny random Qwen3 instead of SmolLM2, short prompts, one round, one
stream; its figures mean nothing.

1. Prefill: time to first token of one 512-token prompt, as tokens/s.
2. Decode: 128 greedy tokens after a short prompt at batch 1 (and batch 8 for
   Roundhouse, which batches), as tokens/s excluding the first token.
   Roundhouse runs its real engine (scheduler, paged KV, sampler) in-process;
   transformers runs generate() with its KV cache. Both in float32.
3. Router overhead: time to first streamed byte through the HTTP router minus
   the engine's own time to first token for the same prompt, driven straight
   over ZeroMQ, at 1 and 32 concurrent streams. Medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import protocol as p  # noqa: E402
from router.default_model import ensure_default_model  # noqa: E402

PREFILL_TOKENS = 512
DECODE_TOKENS = 128
BATCH = 8
CONCURRENCY = (1, 32)


def smoke_sizes() -> None:
    global PREFILL_TOKENS, DECODE_TOKENS, BATCH, CONCURRENCY
    PREFILL_TOKENS, DECODE_TOKENS, BATCH, CONCURRENCY = 16, 4, 2, (1,)


def engine_core(model: Path, threads: int):  # type: ignore[no-untyped-def]
    from engine.process.bootstrap import build_engine

    torch.set_num_threads(threads)
    options = p.EngineOptions(max_batched_tokens=PREFILL_TOKENS, max_concurrency=8,
                              kv_capacity_tokens=16384, threads=threads)
    events: list[p.EngineEvent] = []
    core, _ = build_engine(model, options, lambda f, m: None, events.append)
    return core, events


def roundhouse_run(core, events, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(seconds to the first token of every request, seconds for the rest)."""
    events.clear()
    core.scheduler.kv.pool.clear_cache()  # no prefix reuse between measurements
    params = p.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        core.handle(p.Generate(f"r{index}", prompt, params))
    first = None
    while core.has_work:
        core.step()
        if first is None and all(
            any(o.token_ids for e in events for o in e.outputs if o.request_id == f"r{i}")
            for i in range(len(prompts))
        ):
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - start, end - first


def hf_run(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        total = time.perf_counter() - start
    return first, total - first


def bench_engines(model_path: Path, threads: int, rounds: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(100, 49000, (PREFILL_TOKENS,), generator=gen).tolist()
    short_prompts = [torch.randint(100, 49000, (16,), generator=gen).tolist() for _ in range(BATCH)]

    core, events = engine_core(model_path, threads)
    if model_path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                  dtype=torch.float32).eval()
    results: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    roundhouse_run(core, events, [short_prompts[0]], 4)  # warm-up
    hf_run(hf, short_prompts[0], 4)
    for _ in range(rounds):
        ttft, _ = roundhouse_run(core, events, [long_prompt], 1)
        record("roundhouse_prefill_tok_s", PREFILL_TOKENS / ttft)
        ttft, _ = hf_run(hf, long_prompt, 1)
        record("hf_prefill_tok_s", PREFILL_TOKENS / ttft)
        _, rest = roundhouse_run(core, events, [short_prompts[0]], DECODE_TOKENS)
        record("roundhouse_decode_b1_tok_s", (DECODE_TOKENS - 1) / rest)
        _, rest = hf_run(hf, short_prompts[0], DECODE_TOKENS)
        record("hf_decode_b1_tok_s", (DECODE_TOKENS - 1) / rest)
        _, rest = roundhouse_run(core, events, short_prompts, DECODE_TOKENS)
        record(f"roundhouse_decode_b{BATCH}_tok_s", BATCH * (DECODE_TOKENS - 1) / rest)
    return {name: statistics.median(values) for name, values in results.items()}


async def engine_ttft(model_path: Path, prompt: list[int], concurrency: int, rounds: int,
                      threads: int) -> float:
    """Median time to first token straight over ZeroMQ, no HTTP."""
    import dataclasses
    import tempfile

    from router.catalog import entry_for_path
    from router.supervisor import EngineProcess

    entry = entry_for_path(model_path)
    options = p.EngineOptions(threads=threads, max_concurrency=32)
    entry = dataclasses.replace(entry, settings=dataclasses.replace(entry.settings, engine=options))
    with tempfile.TemporaryDirectory() as run_dir:
        engine = EngineProcess(entry, Path(run_dir), 0)
        await engine.start(300, lambda event: None)
        params = p.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        samples: list[float] = []
        try:
            for round_index in range(rounds + 1):
                async def one(request_id: str) -> float:
                    start = time.perf_counter()
                    stream = engine.client.submit(request_id, prompt, params)
                    first = None
                    async for output in stream:
                        if first is None and output.token_ids:
                            first = time.perf_counter() - start
                    assert first is not None
                    return first

                times = await asyncio.gather(*(one(f"b{round_index}-{i}") for i in range(concurrency)))
                if round_index:  # the first round warms up
                    samples.extend(times)
        finally:
            await engine.stop()
    return statistics.median(samples)


async def router_ttfb(url: str, question: str, concurrency: int, rounds: int) -> float:
    import aiohttp

    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    samples: list[float] = []
    async with aiohttp.ClientSession() as session:
        for round_index in range(rounds + 1):
            async def one() -> float:
                start = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    first = None
                    async for line in response.content:
                        if first is None and b'"content":"' in line and b'"content":""' not in line:
                            first = time.perf_counter() - start
                    assert first is not None
                    return first

            times = await asyncio.gather(*(one() for _ in range(concurrency)))
            if round_index:
                samples.extend(times)
    return statistics.median(samples)


def bench_router(model_path: Path, threads: int, rounds: int) -> dict[str, float]:
    from router.text.model_text import ModelText
    from tests.support.server import running_server

    question = "What is the capital of France?"
    text = ModelText.load(model_path)
    prompt = text.encode_prompt(text.render_chat([{"role": "user", "content": question}]))
    results: dict[str, float] = {}
    for concurrency in CONCURRENCY:
        engine = asyncio.run(engine_ttft(model_path, prompt, concurrency, rounds, threads))
        with running_server([str(model_path), "--threads", str(threads), "--max-concurrency", "32"],
                            Path("/tmp/roundhouse-bench-router.log")) as server:
            through_router = asyncio.run(router_ttfb(server.url, question, concurrency, rounds))
        results[f"engine_ttft_ms_c{concurrency}"] = engine * 1000
        results[f"router_ttfb_ms_c{concurrency}"] = through_router * 1000
        results[f"router_added_ms_c{concurrency}"] = (through_router - engine) * 1000
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model", type=Path, help="a GGUF file or HF directory (default: SmolLM2)")
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run that only checks "
                        "the benchmark works: tiny random model, one round")
    args = parser.parse_args()
    if args.smoke:
        import tempfile

        from tests.support.tiny_models import build_tiny_model

        smoke_sizes()
        args.rounds = 1
        args.threads = min(args.threads, 2)
        scratch = tempfile.TemporaryDirectory()  # removed when main returns
        model_path = args.model or build_tiny_model("qwen3", Path(scratch.name) / "tiny-qwen3")
    else:
        model_path = args.model or ensure_default_model()
    report: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads,
        "torch": torch.__version__,
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip(),
    }
    report.update(bench_engines(model_path, args.threads, args.rounds))
    report.update(bench_router(model_path, args.threads, args.rounds))
    for key, value in report.items():
        print(f"{key:32s} {value:.1f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
