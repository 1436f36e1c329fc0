"""The router's CPU cost per streamed token, behind an engine that keeps a real pace.

    .venv/bin/python tests/perf/bench_router_streaming.py [--clients 64] [--max-tokens 256] [--rounds 5]
    .venv/bin/python tests/perf/bench_router_streaming.py --api completions --profile /tmp/router.prof
    .venv/bin/python tests/perf/bench_router_streaming.py --smoke    # seconds: does it run?

The real router (`python -m router serve`) serves one model whose engine is
tests/support/paced_engine.py: every --step-ms (default 2, an H200's decode
step at 64 streams) it sends one StepOutputs carrying one token for every
running request, until max_tokens, as a batched decode step does, with the
Qwen3 tokenizer's ids of real text (so the router detokenizes for real).
--clients concurrent streams (ignore_eos, usage asked for) of
/v1/completions, then of /v1/chat/completions, come from a few client
processes (one Python process parsing every event would set the pace itself).

Per API and round it reads the router process's CPU seconds (user + system,
all its threads, psutil) over the run and divides them by the tokens
streamed: the figure to compare, as it depends little on how this machine's
cores are shared between the router, the engine and the clients. The round
with the median cost is reported, with every round's cost. Also: tokens/s,
the share of the router's CPU time spent by its event loop's thread, and the
gap between two content events of a stream as its client saw them (p50/p99;
a router that falls behind delivers in bursts, so p50 collapses toward 0 and
p99 grows; on a small machine the clients' own CPU shows here too).

--profile PATH runs the router under cProfile (started by this script, never
by the product), timing the CPU time of the event loop's thread (each timer
read is a system call, so absolute times are inflated: compare shares), and
writes its stats to PATH when the router exits; the top functions are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.scripted_models import scripted_model  # noqa: E402
from tests.support.server import Server, running_server  # noqa: E402

MODEL = "bench"
ENGINE_ENV = {"ROUNDHOUSE_ENGINE_MODULE": "tests.support.paced_engine"}
APIS = ("completions", "chat")

# What the paced engine streams (repeated as needed): prose with punctuation,
# digits, code and a few multi-byte characters, so the detokenizer sees what
# real output holds.
STREAM_TEXT = (
    "The roundhouse stood at the end of the yard, its turntable worn smooth by a "
    "hundred years of engines. Each morning the crew lit the boilers at 5:30, "
    "checked the water (about 2,400 litres a tender) and oiled every crank. "
    "\"Steam up!\" called the foreman; the café across the tracks opened its "
    "shutters. In the office a clerk typed `schedule[\"07:15\"] = {\"track\": 4}` "
    "and sighed: naïve timetables never survive the first frost. Über-long "
    "freights rolled past at 40 km/h — slow, but steady — while the signal "
    "box logged each one: 東京, München, Zürich, São Paulo. "
)

WORDS = ("engine turntable stall coal water track signal yard roof steam boiler piston "
         "wheel crank valve smoke whistle rail sleeper junction").split()

# Runs `python -m router` under cProfile; argv[1] is where the stats go.
PROFILED_ROUTER = """\
import cProfile, runpy, sys, time
path = sys.argv.pop(1)
# CPU time of the event loop's thread: wall time would count the waits.
profiler = cProfile.Profile(time.thread_time)
profiler.enable()
try:
    runpy.run_module("router", run_name="__main__")
finally:
    profiler.disable()
    profiler.dump_stats(path)
"""


@contextmanager
def router(args: list[str], log_path: Path, profile: Path | None) -> Iterator[Server]:
    """`python -m router serve` (under cProfile when profile is given) on a
    free port, stopped with SIGTERM so that it exits as a service does (and
    writes its profile)."""
    launcher = ("-c", PROFILED_ROUTER, str(profile)) if profile else ("-m", "router")
    with running_server(args, log_path, timeout=120, env=ENGINE_ENV, launcher=launcher,
                        stop_timeout=60) as server:
        yield server


def request_body(api: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    common = {"model": MODEL, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
              "temperature": 0, "stream_options": {"include_usage": True}}
    if api == "completions":
        return "/v1/completions", {**common, "prompt": prompt}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


def has_text(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries generated text (either API)."""
    choices = chunk.get("choices")
    if not choices:
        return False
    choice = choices[0]
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def one_stream(session: aiohttp.ClientSession, url: str, api: str, prompt: str,
                     max_tokens: int) -> tuple[int, int, list[float]]:
    """(tokens by the usage chunk, content events, gaps between content events)."""
    path, body = request_body(api, prompt, max_tokens)
    decode = msgspec.json.decode
    gaps: list[float] = []
    tokens = events = 0
    last = 0.0
    pending = b""
    async with session.post(url + path, json=body) as response:
        response.raise_for_status()
        async for data in response.content.iter_any():
            now = time.perf_counter()
            *complete, pending = (pending + data).split(b"\n\n")
            for event in complete:
                if not event.startswith(b"data: {"):
                    continue  # [DONE], keep-alives
                chunk = decode(event[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if has_text(chunk):
                    if events:
                        gaps.append(now - last)
                    events += 1
                    last = now
    return tokens, events, gaps


async def _client_share(url: str, api: str, prompts: list[str], max_tokens: int,
                        barrier: Any) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        await one_stream(session, url, api, "warm up", 4)
        barrier.wait()  # every client process warmed up; the router's CPU clock starts
        # This process's own collections would look like the router's stalls.
        gc.collect()
        gc.disable()
        try:
            results = await asyncio.gather(*(one_stream(session, url, api, prompt, max_tokens)
                                             for prompt in prompts))
        finally:
            gc.enable()
    return {"tokens": sum(r[0] for r in results), "events": sum(r[1] for r in results),
            "gaps": [gap for r in results for gap in r[2]]}


def client_share(url: str, api: str, prompts: list[str], max_tokens: int,
                 barrier: Any) -> dict[str, Any]:
    return asyncio.run(_client_share(url, api, prompts, max_tokens, barrier))


def cpu_seconds(process: psutil.Process) -> tuple[float, float, float]:
    """(user, system) CPU seconds of the process, all its threads, and the
    CPU seconds of its main thread alone (the event loop's)."""
    times = process.cpu_times()
    main = next((t.user_time + t.system_time for t in process.threads() if t.id == process.pid),
                0.0)
    return times.user, times.system, main


def run_api(server: Server, api: str, clients: int, max_tokens: int, prompt_words: int,
            processes: int) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(prompt_words)) for _ in range(clients)]
    shares = [prompts[index::processes] for index in range(processes)]
    router_process = psutil.Process(server.process.pid)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, \
            ProcessPoolExecutor(processes, mp_context=context) as pool:
        barrier = manager.Barrier(processes + 1)
        futures = [pool.submit(client_share, server.url, api, share, max_tokens, barrier)
                   for share in shares]
        barrier.wait(timeout=120)
        cpu_before, started = cpu_seconds(router_process), time.perf_counter()
        results = [future.result() for future in futures]
        cpu_after, ended = cpu_seconds(router_process), time.perf_counter()
    tokens = sum(r["tokens"] for r in results)
    expected = clients * max_tokens
    if tokens != expected:
        raise SystemExit(f"{api}: {tokens} tokens streamed, {expected} expected")
    gaps = sorted(gap for r in results for gap in r["gaps"])
    seconds = ended - started
    user, system, loop = (after - before for after, before in zip(cpu_after, cpu_before,
                                                                  strict=True))
    cpu = user + system
    return {
        "api": api, "clients": clients, "max_tokens": max_tokens, "tokens": tokens,
        "content_events": sum(r["events"] for r in results), "seconds": round(seconds, 3),
        "tok_s": round(tokens / seconds), "router_cpu_s": round(cpu, 3),
        "router_loop_thread_share": round(loop / cpu, 2) if cpu else None,
        "router_cpu_us_per_token": round(cpu / tokens * 1e6, 1),
        "router_cpu_share": round(cpu / seconds, 2),
        "gap_p50_ms": round(statistics.median(gaps) * 1e3, 3) if gaps else None,
        "gap_p99_ms": round(gaps[int(0.99 * (len(gaps) - 1))] * 1e3, 2) if gaps else None,
    }


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median CPU cost per token, and every round's cost."""
    ordered = sorted(rounds, key=lambda r: r["router_cpu_us_per_token"])
    return {**ordered[len(ordered) // 2],
            "rounds_cpu_us_per_token": [r["router_cpu_us_per_token"] for r in rounds]}


def model_dir(work: Path, base: Path | None, step_ms: float) -> Path:
    """A models directory holding MODEL: a tiny Qwen3 (tokenizer, template,
    config) and the paced engine's script."""
    if base is None:
        from tests.support.tiny_models import build_tiny_model

        base = build_tiny_model("qwen3", work / "base")
    models = work / "models"
    models.mkdir()
    scripted_model(models / MODEL, base, {"default": STREAM_TEXT, "step_seconds": step_ms / 1000})
    return models


def print_profile(path: Path, lines: int) -> None:
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=2.0, help="the engine's step time")
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per API; the median round is reported, every round listed")
    parser.add_argument("--api", choices=(*APIS, "both"), default="both")
    parser.add_argument("--model", type=Path,
                        help="a tiny Hugging Face Qwen3 directory to take the tokenizer and "
                             "config from (default: build one)")
    parser.add_argument("--profile", type=Path, help="run the router under cProfile; stats to here")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--smoke", action="store_true",
                        help="only check that it runs: 4 streams of 16 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.max_tokens, args.client_processes, args.prompt_words = 4, 16, 1, 8
        args.rounds = 1
    apis = APIS if args.api == "both" else (args.api,)
    with tempfile.TemporaryDirectory(prefix="roundhouse-streaming-") as tmp:
        work = Path(tmp)
        models = model_dir(work, args.model, args.step_ms)
        serve = ["--models-dir", str(models), "--max-concurrency", str(args.clients),
                 "--max-pending-requests", str(args.clients * 2)]
        results = []
        with router(serve, work / "router.log", args.profile) as server:
            for api in apis:
                rounds = [run_api(server, api, args.clients, args.max_tokens, args.prompt_words,
                                  args.client_processes) for _ in range(args.rounds)]
                results.append(median_round(rounds))
    report = {"date": time.strftime("%Y-%m-%d"), "cpus": psutil.cpu_count(),
              "command": " ".join(sys.argv), "step_ms": args.step_ms, "results": results}
    print(json.dumps(report, indent=2))
    for r in results:
        print(f"{r['api']}: {r['router_cpu_us_per_token']} us of router CPU per token "
              f"(rounds {r['rounds_cpu_us_per_token']}), {r['tok_s']} tok/s, "
              f"event gaps p50 {r['gap_p50_ms']} ms p99 {r['gap_p99_ms']} ms")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.profile:
        print_profile(args.profile, 40)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
