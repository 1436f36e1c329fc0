"""Streaming through the HTTP router against the engine's own figure, on the GPU.

    python tests/perf/bench_gpu_http.py [--clients 64] [--max-tokens 256]

To see which process paused when, run it with the garbage-collector probe:
    ROUNDHOUSE_GC_PROBE=$OUT/gc PYTHONPATH=tests/perf/gc_probe:$PYTHONPATH \
        python tests/perf/bench_gpu_http.py

A random-weight Qwen3-0.6B with the real Qwen3 tokenizer is written to disk.
First the engine alone runs the workload in-process (no HTTP, no IPC): the
same number of requests, prompt lengths and output lengths. Then
`roundhouse serve` serves the model and that many concurrent clients stream
/v1/completions (ignore_eos) over aiohttp, from a few client processes (one
would be the bottleneck): output tok/s over the wall time,
and the p50/p99 inter-token latency seen by the clients (the gap between two
streamed chunks, divided by the tokens the later one carried).

Writes $OUT/bench_gpu_http.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import torch

import protocol as p
from tests.perf.bench_lifecycle import write_model
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB, make_engine, random_model
from tests.support.fixtures import QWEN3_TOKENIZER_FILES, ensure_qwen3_tokenizer
from tests.support.server import running_server

# Gaps longer than this are listed with their wall-clock time, to be matched
# against what the processes logged (tests/perf/gc_probe/).
SLOW_GAP_SECONDS = 0.008

WORDS = ("engine turntable stall coal water track signal yard roof steam boiler piston "
         "wheel crank valve smoke whistle rail sleeper junction").split()


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def engine_alone(clients: int, max_tokens: int, prompt_tokens: int) -> dict[str, float]:
    loaded = random_model("qwen3-0.6b", torch.device("cuda"))
    core, _ = make_engine(loaded, max_concurrency=clients, max_batched_tokens=8192,
                          max_context=4096)
    rng = random.Random(0)
    params = p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # The first round of the same shape captures the graphs its steps need
    # (as the server's first requests do); the second is timed.
    seconds = 0.0
    for round_index in range(2):
        started = time.perf_counter()
        for index in range(clients):
            prompt = [rng.randrange(QWEN3_TEXT_VOCAB) for _ in range(prompt_tokens)]
            core.handle(p.Generate(f"r{round_index}-{index}", prompt, params))
        while core.has_work:
            core.step()
        seconds = time.perf_counter() - started
    core.runner.sleep("disk", [])
    del core, loaded
    torch.cuda.empty_cache()
    return {"seconds": seconds, "output_tok_s": clients * max_tokens / seconds}


async def one_client(session: aiohttp.ClientSession, url: str, text: str,
                     max_tokens: int, slow: list[tuple[float, float]]) -> tuple[int, list[float]]:
    body = {"model": "bench", "prompt": text, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    gaps: list[float] = []
    tokens = 0
    last = None
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
                if now - last > SLOW_GAP_SECONDS:
                    slow.append((time.time(), (now - last) * 1e3))
            last = now
    return tokens, gaps


async def _client_share(url: str, texts: list[str], max_tokens: int,
                        start_at: float) -> dict[str, Any]:
    """One client process's streams, started together at wall time start_at."""
    # A stream that stalls this long is a failure to report, not to wait out.
    timeout = aiohttp.ClientTimeout(total=180)
    slow: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one_client(session, url, "warm up", 16, [])
        # This process's own full collections would show as the server's stalls.
        gc.collect()
        gc.disable()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        started = time.time()
        try:
            results = await asyncio.gather(*(one_client(session, url, text, max_tokens, slow)
                                             for text in texts))
        finally:
            gc.enable()
        ended = time.time()
    return {"tokens": sum(count for count, _ in results), "started": started, "ended": ended,
            "gaps": [gap for _, gaps in results for gap in gaps], "slow": slow}


def client_share(url: str, texts: list[str], max_tokens: int, start_at: float) -> dict[str, Any]:
    return asyncio.run(_client_share(url, texts, max_tokens, start_at))


def clients_run(url: str, clients: int, max_tokens: int, words: int,
                processes: int) -> dict[str, Any]:
    """`clients` streams from `processes` client processes: one Python process
    parsing every stream's events falls behind near 25,000 events a second on
    the H200 host, and then it, not the server, sets the pace."""
    rng = random.Random(0)
    texts = [prompt_text(rng, words) for _ in range(clients)]
    shares = [texts[index::processes] for index in range(processes)]
    start_at = time.time() + 8.0  # every process imported and warmed up by then
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        results = list(pool.map(client_share, [url] * processes, shares,
                                [max_tokens] * processes, [start_at] * processes))
    seconds = max(r["ended"] for r in results) - min(r["started"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    gaps = sorted(gap for r in results for gap in r["gaps"])
    slow = sorted((round(at, 4), round(ms, 1)) for r in results for at, ms in r["slow"])
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "client_processes": processes, "itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_p99_ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3, "chunks": len(gaps),
            "slow_gaps": slow}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--client-processes", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="roundhouse-http-"))
    out = os.environ.get("OUT")
    # The server's log goes where it survives a run that is cut short.
    log_dir = Path(out) if out else work
    model_dir = work / "bench"
    write_model("0.6b", model_dir, "cuda")
    tokenizer = ensure_qwen3_tokenizer()
    for name in QWEN3_TOKENIZER_FILES:
        (model_dir / name).write_bytes((tokenizer / name).read_bytes())
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"),
                              "device": torch.cuda.get_device_name(),
                              "clients": args.clients, "max_tokens": args.max_tokens}
    # The prompt of a client is about 1.3 tokens per word with Qwen3's tokenizer.
    result["engine"] = engine_alone(args.clients, args.max_tokens, int(args.prompt_words * 1.3))
    print(f"engine alone: {result['engine']}", flush=True)
    serve = [str(model_dir), "--device", "cuda", "--max-concurrency", str(args.clients),
             "--max-batched-tokens", "8192", "--max-context", "4096", "--load-timeout", "600"]
    with running_server(serve, log_dir / "bench_gpu_http_server.log", timeout=300) as server:
        print(f"serving on {server.url}", flush=True)
        result["http"] = clients_run(server.url, args.clients, args.max_tokens,
                                     args.prompt_words, args.client_processes)
    result["http_over_engine"] = result["http"]["output_tok_s"] / result["engine"]["output_tok_s"]
    if out:
        Path(out, "bench_gpu_http.json").write_text(json.dumps(result, indent=2))
    http, engine = result["http"], result["engine"]
    print(f"{args.clients} streaming clients x {args.max_tokens} tokens: HTTP "
          f"{http['output_tok_s']:.0f} tok/s (ITL p50 {http['itl_p50_ms']:.1f} ms, p99 "
          f"{http['itl_p99_ms']:.1f} ms); engine alone {engine['output_tok_s']:.0f} tok/s "
          f"({result['http_over_engine']:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
