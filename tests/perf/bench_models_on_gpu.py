"""Many models on one GPU, through the router's HTTP API, as a client sees it.

    python3 tests/perf/bench_models_on_gpu.py [--json out.json]     # on the GPU machine
    python3 tests/perf/bench_models_on_gpu.py --smoke               # a CPU check of the script

Three measurements, each with Qwen3 shapes whose weights are zeros in sparse
files (tests/support/sparse_checkpoint.py: nothing about memory or speed
depends on the values):

1. capacity: how many 0.6B-shape models with 8 lanes x 8k context stay
   resident on one GPU with default options: they are loaded one by one
   (POST /models/load?wait=1, --models-max 0) until one load makes room by
   evicting another; for each, its planned bytes against what its engine
   reported holding;
2. round robin over 4 resident models: time to first token of streamed
   requests, against a single-model server in the same run;
3. switching: round robin over 3 models when only 2 fit (device shares),
   so each request puts the least recently used model to sleep and wakes
   its own: the latency each request pays, weights kept in host memory and
   read again from disk, against the same requests to resident models.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.server import Server, running_server  # noqa: E402
from tests.support.sparse_checkpoint import write_sparse_qwen3  # noqa: E402


def prompt(i: int) -> str:
    # Distinct prompts of about 150 tokens, so no request hits the prefix cache.
    return f"Request {i}: " + " ".join(f"word{i}-{j}" for j in range(60))


def ttft(server: Server, model: str, text: str, max_tokens: int = 8) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    started = time.perf_counter()
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": True}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True,
                       timeout=300) as reply:
        reply.raise_for_status()
        first = None
        for line in reply.iter_lines():
            if first is None and line.startswith(b"data: {") and b'"content":"' in line:
                first = time.perf_counter() - started
        if first is None:
            raise RuntimeError(f"{model}: no content in the stream")
        return first


def latency(server: Server, model: str, text: str) -> float:
    started = time.perf_counter()
    reply = server.post("/v1/chat/completions",
                        json={"model": model, "messages": [{"role": "user", "content": text}],
                              "max_tokens": 1})
    reply.raise_for_status()
    return time.perf_counter() - started


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_ms": round(statistics.median(ordered) * 1000, 2),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
            "n": len(ordered)}


def states(server: Server) -> dict[str, dict[str, Any]]:
    return {card["id"]: card for card in server.get("/models").json()["data"]}


def capacity(root: Path, shape: str, context: int, limit: int, device_args: list[str],
             log: Path) -> dict[str, Any]:
    models = root / "capacity"
    names = [f"m{i:02d}" for i in range(limit)]
    for name in names:
        write_sparse_qwen3(models / name, shape)
    preset = root / "capacity.ini"
    preset.write_text(f"[*]\nmax-context = {context}\nmax-concurrency = 8\n")
    args = ["--models-dir", str(models), "--models-preset", str(preset), "--models-max", "0",
            *device_args]
    loaded: list[dict[str, Any]] = []
    with running_server(args, log) as server:
        for name in names:
            started = time.perf_counter()
            reply = server.post("/models/load?wait=1", json={"model": name})
            seconds = time.perf_counter() - started
            if reply.status_code != 200:
                loaded.append({"model": name, "refused": reply.json()})
                break
            cards = states(server)
            resident = [n for n, card in cards.items() if card["status"]["value"] == "loaded"]
            memory = cards[name].get("memory") or {}
            held = memory.get("held") or {}
            loaded.append({"model": name, "load_seconds": round(seconds, 2),
                           "planned_bytes": memory.get("planned_bytes"),
                           "held_bytes": held.get("footprint_bytes"),
                           "resident": len(resident)})
            if len(resident) < len(loaded):
                break  # this load evicted one: the GPU is full
        ledger = server.get("/v1/load").json().get("devices", [])
    fits = max((entry.get("resident", 0) for entry in loaded), default=0)
    return {"shape": shape, "context": context, "lanes": 8, "resident_at_once": fits,
            "loads": loaded, "devices": ledger}


def round_robin(root: Path, shape: str, count: int, rounds: int, context: int,
                device_args: list[str], log: Path) -> dict[str, Any]:
    models = root / "rr"
    names = [f"rr{i}" for i in range(count)]
    for name in names:
        write_sparse_qwen3(models / name, shape)
    preset = root / "rr.ini"
    preset.write_text(f"[*]\nmax-context = {context}\n")
    args = ["--models-dir", str(models), "--models-preset", str(preset), *device_args]
    with running_server(args, log) as server:
        for name in names:
            ttft(server, name, "warm up")
        many = [ttft(server, names[i % count], prompt(i)) for i in range(rounds)]
    single_args = [str(models / names[0]), "--max-context", str(context), *device_args]
    with running_server(single_args, log.with_suffix(".single.log")) as server:
        ttft(server, names[0], "warm up")
        one = [ttft(server, names[0], prompt(i)) for i in range(rounds)]
    return {"models": count, "ttft_round_robin": summary(many), "ttft_single_model": summary(one),
            "ratio_median": round(statistics.median(many) / statistics.median(one), 3)}


def switching(root: Path, shape: str, share_mib: int, rounds: int, device_args: list[str],
              log: Path) -> dict[str, Any]:
    models = root / "switch"
    names = ["s0", "s1", "s2"]
    for name in names:
        write_sparse_qwen3(models / name, shape)
    results: dict[str, Any] = {"share_mib": share_mib}
    for weights in ("host", "disk"):
        preset = root / f"switch-{weights}.ini"
        preset.write_text(f"[*]\nmax-context = 8192\ndevice-memory-mib = {share_mib}\n"
                          f"model-suspend = true\nsuspend-weights = {weights}\n")
        args = ["--models-dir", str(models), "--models-preset", str(preset), *device_args]
        with running_server(args, log.with_suffix(f".{weights}.log")) as server:
            for name in names:
                latency(server, name, "warm up")
            resident = [latency(server, names[i % 2], prompt(i)) for i in range(rounds)]
            switched = [latency(server, names[i % 3], prompt(i)) for i in range(rounds)]
            evictions = server.log().count("(least recently used) to make room for")
        results[weights] = {"resident_two": summary(resident), "switching_three": summary(switched),
                            "switch_cost_median_ms": round(
                                (statistics.median(switched) - statistics.median(resident)) * 1000,
                                1),
                            "evictions": evictions}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny counts on the CPU: checks the script runs, measures nothing")
    parser.add_argument("--max-models", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--parts", default="capacity,round_robin,switching")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="roundhouse-bench-gpu-"))
    parts = set(args.parts.split(","))
    if args.smoke:
        # Two models: each is an engine start, and one round robin shows the path.
        shape, device_args, limit, rounds, context = "qwen3-tiny", ["--device", "cpu"], 2, 3, 2048
        parts, robin = {"round_robin"}, 2
    else:
        shape, device_args, limit, rounds, context = "qwen3-0.6b", [], args.max_models, \
            args.rounds, 8192
        robin = 4
    # Two shares fit on an H200 (141 GB), three do not.
    share = 60000
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "smoke": args.smoke,
                              "shape": shape}
    if "capacity" in parts:
        result["capacity"] = capacity(root, shape, context, limit, device_args,
                                      root / "capacity.log")
        print(json.dumps(result["capacity"]["resident_at_once"]), flush=True)
    if "round_robin" in parts:
        result["round_robin"] = round_robin(root, shape, robin, rounds, context, device_args,
                                            root / "rr.log")
        print(json.dumps(result["round_robin"]), flush=True)
    if "switching" in parts:
        result["switching"] = switching(root, shape, share, max(rounds // 2, 3), device_args,
                                        root / "switch.log")
        print(json.dumps(result["switching"]), flush=True)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
