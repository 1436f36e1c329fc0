"""Embeddings throughput: inputs a second for many short inputs, the engine
alone and through the HTTP router.

    python tests/perf/bench_embeddings.py [--inputs 10000] [--tokens 16] [--batch 256]
                                          [--clients 8] [--lanes 256] [--smoke]

Random weights at Qwen3-0.6B's shape (bfloat16, on the GPU) with the real
Qwen3 tokenizer, last-token pooling:
1. engine alone, in-process: `--inputs` embedding requests of `--tokens`
   random token ids each, submitted at once and stepped until done;
2. `roundhouse serve` on the same shape (written to disk) and `--clients`
   concurrent clients POSTing /v1/embeddings with `--batch` texts of about
   `--tokens` tokens each until `--inputs` texts are embedded, with base64
   answers (the openai SDK's default) and then with float ones (JSON lists).
Each figure is inputs/s over the wall time, after a warm-up.

--smoke runs it all on the CPU at a tiny shape in seconds
(tests/test_perf_smoke.py), so the script cannot rot. Writes every figure to
$OUT/bench_embeddings.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import protocol as p  # noqa: E402
from tests.perf.bench_lifecycle import write_model  # noqa: E402
from tests.perf.gpu_models import make_engine, random_model  # noqa: E402
from tests.support.fixtures import QWEN3_TOKENIZER_FILES, ensure_qwen3_tokenizer  # noqa: E402
from tests.support.server import running_server  # noqa: E402

WORDS = ("engine turntable stall coal water track signal yard roof steam boiler piston "
         "wheel crank valve smoke whistle rail sleeper junction").split()


def text_of(rng: random.Random, tokens: int) -> str:
    # About one token a word with Qwen3's tokenizer, for these words.
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def engine_alone(smoke: bool, inputs: int, tokens: int, lanes: int) -> dict[str, float]:
    device = torch.device("cpu" if smoke else "cuda")
    loaded = random_model("tiny" if smoke else "qwen3-0.6b", device,
                          dtype=torch.float32 if smoke else torch.bfloat16)
    core, _ = make_engine(loaded, device=device.type, dtype="float32" if smoke else "bfloat16",
                          max_concurrency=lanes, max_batched_tokens=8192, max_context=4096)
    rng = random.Random(0)
    params = p.SamplingParams(max_tokens=0, pooling="last")

    def run(tag: str, count: int) -> float:
        prompts = [[rng.randrange(1000, 100_000) for _ in range(tokens)] for _ in range(count)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            core.handle(p.Generate(f"{tag}-{index}", prompt, params))
        while core.has_work:
            core.step()
        return time.perf_counter() - started

    run("warm", min(inputs, 2 * lanes))
    seconds = run("timed", inputs)
    # The HTTP run's engine needs the device memory back.
    core.runner.sleep("disk", [])
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": seconds, "inputs_s": inputs / seconds,
            "prompt_tok_s": inputs * tokens / seconds}


async def _clients(url: str, texts: list[str], batch: int, clients: int,
                   encoding: str) -> float:
    """Seconds for `clients` concurrent clients to embed every text, `batch` a request."""
    batches = [texts[start:start + batch] for start in range(0, len(texts), batch)]
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for item in batches:
        queue.put_nowait(item)

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            item = queue.get_nowait()
            body = {"model": "bench", "input": item, "encoding_format": encoding}
            async with session.post(url + "/v1/embeddings", json=body) as response:
                response.raise_for_status()
                answer = await response.json()
                assert len(answer["data"]) == len(item)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return time.perf_counter() - started


def through_http(smoke: bool, inputs: int, tokens: int, batch: int, clients: int,
                 lanes: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="roundhouse-embeddings-"))
    model_dir = work / "bench"
    write_model("tiny" if smoke else "0.6b", model_dir, "cpu" if smoke else "cuda")
    tokenizer = ensure_qwen3_tokenizer()
    for name in QWEN3_TOKENIZER_FILES:
        (model_dir / name).write_bytes((tokenizer / name).read_bytes())
    rng = random.Random(1)
    serve = [str(model_dir), "--device", "cpu" if smoke else "cuda", "--max-concurrency",
             str(lanes), "--max-batched-tokens", "8192", "--max-context", "4096",
             "--load-timeout", "600"]
    result: dict[str, Any] = {}
    with running_server(serve, work / "server.log", timeout=300) as server:
        warm = [text_of(rng, tokens) for _ in range(min(inputs, 2 * batch))]
        asyncio.run(_clients(server.url, warm, batch, clients, "base64"))
        for encoding in ("base64", "float"):
            texts = [text_of(rng, tokens) for _ in range(inputs)]
            seconds = asyncio.run(_clients(server.url, texts, batch, clients, encoding))
            result[encoding] = {"seconds": seconds, "inputs_s": inputs / seconds}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=16, help="tokens an input (about)")
    parser.add_argument("--batch", type=int, default=256, help="inputs an HTTP request")
    parser.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients")
    parser.add_argument("--lanes", type=int, default=256, help="the engine's max concurrency")
    parser.add_argument("--only", default="engine,http")
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    if args.smoke:
        args.inputs, args.batch, args.clients, args.lanes = 64, 16, 2, 8
    wanted = set(args.only.split(","))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu" if args.smoke else torch.cuda.get_device_name(),
        "shape": "tiny" if args.smoke else "qwen3-0.6b", "inputs": args.inputs,
        "tokens": args.tokens, "batch": args.batch, "clients": args.clients, "lanes": args.lanes}
    if "engine" in wanted:
        results["engine"] = engine_alone(args.smoke, args.inputs, args.tokens, args.lanes)
        print("engine", json.dumps(results["engine"]), flush=True)
    if "http" in wanted:
        results["http"] = through_http(args.smoke, args.inputs, args.tokens, args.batch,
                                       args.clients, args.lanes)
        print("http", json.dumps(results["http"]), flush=True)
    out = os.environ.get("OUT")
    if out and not args.smoke:
        Path(out, "bench_embeddings.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
