"""Streaming through the HTTP router against the engine's own figure, on the GPU.

    python tests/perf/bench_gpu_http.py [--clients 64] [--max-tokens 256]

A random-weight Qwen3-0.6B with the real Qwen3 tokenizer is written to disk.
First the engine alone runs the workload in-process (no HTTP, no IPC): the
same number of requests, prompt lengths and output lengths. Then
`roundhouse serve` serves the model and that many concurrent clients stream
/v1/completions (ignore_eos) over aiohttp: output tok/s over the wall time,
and the p50/p99 inter-token latency seen by the clients (the gap between two
streamed chunks, divided by the tokens the later one carried).

Writes $OUT/bench_gpu_http.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

import protocol as p
from tests.perf.bench_lifecycle import write_model
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB, make_engine, random_model
from tests.support.fixtures import QWEN3_TOKENIZER_FILES, ensure_qwen3_tokenizer
from tests.support.server import running_server

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
    core.handle(p.Generate("warm", [1] * 64, params))
    while core.scheduler.has_work():
        core.step()
    started = time.perf_counter()
    for index in range(clients):
        prompt = [rng.randrange(QWEN3_TEXT_VOCAB) for _ in range(prompt_tokens)]
        core.handle(p.Generate(f"r{index}", prompt, params))
    while core.scheduler.has_work():
        core.step()
    seconds = time.perf_counter() - started
    core.runner.sleep("disk", [])
    del core, loaded
    torch.cuda.empty_cache()
    return {"seconds": seconds, "output_tok_s": clients * max_tokens / seconds}


async def one_client(session: aiohttp.ClientSession, url: str, text: str,
                     max_tokens: int) -> tuple[int, list[float]]:
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
            last = now
    return tokens, gaps


async def clients_run(url: str, clients: int, max_tokens: int, words: int) -> dict[str, float]:
    rng = random.Random(0)
    texts = [prompt_text(rng, words) for _ in range(clients)]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one_client(session, url, "warm up", 16)
        started = time.perf_counter()
        results = await asyncio.gather(*(one_client(session, url, text, max_tokens)
                                         for text in texts))
        seconds = time.perf_counter() - started
    tokens = sum(count for count, _ in results)
    gaps = sorted(gap for _, client_gaps in results for gap in client_gaps)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_p99_ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3, "chunks": len(gaps)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=100)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="roundhouse-http-"))
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
    serve = [str(model_dir), "--device", "cuda", "--max-concurrency", str(args.clients),
             "--max-batched-tokens", "8192", "--max-context", "4096", "--load-timeout", "600"]
    with running_server(serve, work / "server.log", timeout=300) as server:
        result["http"] = asyncio.run(clients_run(server.url, args.clients, args.max_tokens,
                                                 args.prompt_words))
        log_tail = server.log()[-3000:]
    result["http_over_engine"] = result["http"]["output_tok_s"] / result["engine"]["output_tok_s"]
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_gpu_http.json").write_text(json.dumps(result, indent=2))
        Path(out, "bench_gpu_http_server.log").write_text(log_tail)
    http, engine = result["http"], result["engine"]
    print(f"{args.clients} streaming clients x {args.max_tokens} tokens: HTTP "
          f"{http['output_tok_s']:.0f} tok/s (ITL p50 {http['itl_p50_ms']:.1f} ms, p99 "
          f"{http['itl_p99_ms']:.1f} ms); engine alone {engine['output_tok_s']:.0f} tok/s "
          f"({result['http_over_engine']:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
