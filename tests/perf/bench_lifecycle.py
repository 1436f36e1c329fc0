"""Lifecycle benchmark: cold load, sleep and wake of one model through the
router's HTTP API, with the weights kept in host memory and read from disk.

    python tests/perf/bench_lifecycle.py --shape 0.6b --device cuda [--json out.json]
    python tests/perf/bench_lifecycle.py --shape tiny --device cpu     # a quick check
    python tests/perf/bench_lifecycle.py --smoke    # the quickest: tiny, cpu, 1 round, disk

It writes a random-weight Qwen3 at real shapes (bfloat16 safetensors, the real
Qwen3 tokenizer) into a temporary models directory, then for each weights mode
starts `python -m router serve --models-dir DIR --model-suspend
--suspend-weights MODE --models-max 1` and measures, as a client sees them:
- cold load: POST /models/load on an unloaded model (engine start + load);
- sleep: POST /models/sleep;
- wake: POST /models/load on the sleeping model;
after every wake a tiny greedy completion proves the model works, and a
longer prompt sent before the first sleep reports how many of its tokens came
from the prefix cache (kept across the sleep). The engine's own seconds and the
device bytes it still held asleep are read from the router's log.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.fixtures import QWEN3_TOKENIZER_FILES, ensure_qwen3_tokenizer  # noqa: E402
from tests.support.server import Server, running_server  # noqa: E402

MODEL_ID = "qwen3-bench"
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                 tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, intermediate_size=12288,
               tie_word_embeddings=False),
}
COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_theta=1_000_000.0, bos_token_id=151643, eos_token_id=151645)
SHARD_BYTES = 2 * 2**30
# A prompt of a few hundred tokens: several KV pages for the prefix cache to keep.
CACHED_PROMPT = "Roundhouses were built around turntables. " * 40


def write_model(shape: str, target: Path, init_device: str) -> int:
    """A random-weight Qwen3 in bfloat16, one tensor at a time and in shards of
    SHARD_BYTES, so host memory holds at most a shard. Returns the weight bytes."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.Qwen3Config(**COMMON, **SHAPES[shape])
    config.architectures = ["Qwen3ForCausalLM"]
    # The meta device gives every tensor's name and shape without memory.
    with torch.device("meta"):
        meta = transformers.Qwen3ForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    target.mkdir(parents=True)
    config.save_pretrained(target)
    generator = torch.Generator(device=init_device).manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0
    files: list[str] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(target / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes = {}, 0

    for name, dims in shapes.items():
        tensor = torch.empty(dims, dtype=torch.bfloat16, device=init_device)
        if len(dims) == 1:
            tensor.fill_(1.0)  # RMSNorm weights
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
        tensor = tensor.cpu()
        if shard and shard_bytes + tensor.nbytes > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        total += tensor.nbytes
    flush()
    if init_device != "cpu":
        torch.cuda.empty_cache()  # the engines need that memory, not this process
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    tokenizer = ensure_qwen3_tokenizer()
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, target / name)
    return total


def timed(server: Server, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    # ?wait=1: /models/load answers once the model is loaded, not when it starts.
    response = server.post(path, params={"wait": "1"}, json=body)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"POST {path} answered {response.status_code}: {response.text}\n"
                           f"{server.log()[-3000:]}")
    return seconds, response.json()


def complete(server: Server, prompt: str) -> tuple[float, dict[str, Any]]:
    seconds, answer = timed(server, "/v1/completions", {
        "model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    if not answer.get("choices") or answer["usage"]["completion_tokens"] < 1:
        raise RuntimeError(f"a completion after the wake came back empty: {answer}")
    return seconds, answer


def engine_figures(log: str) -> dict[str, Any]:
    """What the router logged about the engine's latest sleep and wake."""
    figures: dict[str, Any] = {}
    slept = re.findall(r"asleep in ([\d.]+)s \(weights: \w+, (\d+) KV pages kept, "
                       r"(\d+) device bytes", log)
    if slept:
        seconds, pages, device_bytes = slept[-1]
        figures.update(engine_sleep_s=float(seconds), kept_pages=int(pages),
                       device_bytes_asleep=int(device_bytes))
    woke = re.findall(r"woke in ([\d.]+)s", log)
    if woke:
        figures["engine_wake_s"] = float(woke[-1])
    return figures


def bench_mode(models_dir: Path, weights: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    serve = ["--models-dir", str(models_dir), "--device", args.device, "--kv-capacity",
             str(args.kv_capacity), "--models-max", "1", "--model-suspend",
             "--suspend-weights", weights, "--load-timeout", "600"]
    result: dict[str, Any] = {"weights": weights, "rounds": []}
    with running_server(serve, work / f"server-{weights}.log", timeout=120) as server:
        result["cold_load_s"], _ = timed(server, "/models/load", {"model": MODEL_ID})
        result["first_completion_s"], _ = complete(server, "hi")
        complete(server, CACHED_PROMPT)  # fills the prefix cache that sleeps must keep
        for number in range(1, args.rounds + 1):
            sleep_s, _ = timed(server, "/models/sleep", {"model": MODEL_ID})
            asleep = engine_figures(server.log())
            wake_s, _ = timed(server, "/models/load", {"model": MODEL_ID})
            completion_s, _ = complete(server, "hi")
            _, cached = complete(server, CACHED_PROMPT)
            details = cached["usage"].get("prompt_tokens_details") or {}
            row = {"round": number, "sleep_s": sleep_s, "wake_s": wake_s,
                   "completion_s": completion_s,
                   "cached_tokens_after_wake": details.get("cached_tokens"),
                   "prompt_tokens": cached["usage"]["prompt_tokens"],
                   **asleep, **engine_figures(server.log())}
            result["rounds"].append(row)
            print(f"  {weights} round {number}: sleep {sleep_s:.3f}s, wake {wake_s:.3f}s, "
                  f"completion {completion_s:.3f}s, cached {row['cached_tokens_after_wake']}"
                  f"/{row['prompt_tokens']} prompt tokens", flush=True)
    rounds = result["rounds"]
    result["sleep_s_median"] = statistics.median(r["sleep_s"] for r in rounds)
    result["wake_s_median"] = statistics.median(r["wake_s"] for r in rounds)
    result["cold_over_wake"] = result["cold_load_s"] / result["wake_s_median"]
    return result


def print_table(report: dict[str, Any]) -> None:
    print(f"\nQwen3 {report['shape']} random weights, {report['weight_bytes'] / 1e9:.2f} GB bf16, "
          f"device {report['device']}, KV {report['kv_capacity']} tokens, {report['rounds']} rounds")
    header = (f"{'weights':8} {'cold load':>10} {'sleep':>8} {'wake':>8} {'cold/wake':>10} "
              f"{'engine sleep':>13} {'engine wake':>12} {'device bytes asleep':>20} {'cached':>7}")
    print(header)
    print("-" * len(header))
    for mode in report["modes"]:
        last = mode["rounds"][-1]
        engine_sleep = statistics.median(r.get("engine_sleep_s", float("nan")) for r in mode["rounds"])
        engine_wake = statistics.median(r.get("engine_wake_s", float("nan")) for r in mode["rounds"])
        print(f"{mode['weights']:8} {mode['cold_load_s']:9.2f}s {mode['sleep_s_median']:7.2f}s "
              f"{mode['wake_s_median']:7.2f}s {mode['cold_over_wake']:9.1f}x "
              f"{engine_sleep:12.2f}s {engine_wake:11.2f}s "
              f"{last.get('device_bytes_asleep', -1):20,d} {last['cached_tokens_after_wake']!s:>7}")
    print("(sleep and wake: medians of the HTTP round trips; engine: its own seconds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kv-capacity", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weights", default="host,disk", help="modes to measure, comma separated")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the model and logs")
    parser.add_argument("--smoke", action="store_true", help="only check that it runs (seconds): "
                        "tiny shape on the CPU, one round, weights from disk")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.device, args.rounds, args.weights, args.kv_capacity = "tiny", "cpu", 1, "disk", 4096

    work = Path(tempfile.mkdtemp(prefix="roundhouse-lifecycle-"))
    try:
        models_dir = work / "models"
        init_device = "cuda" if args.device.startswith("cuda") else "cpu"
        started = time.perf_counter()
        weight_bytes = write_model(args.shape, models_dir / MODEL_ID, init_device)
        print(f"wrote {weight_bytes / 1e9:.2f} GB of weights in {time.perf_counter() - started:.1f}s "
              f"to {models_dir / MODEL_ID}", flush=True)
        modes = [bench_mode(models_dir, w, args, work) for w in args.weights.split(",")]
        report = {"shape": args.shape, "device": args.device, "kv_capacity": args.kv_capacity,
                  "rounds": args.rounds, "weight_bytes": weight_bytes, "modes": modes}
        if args.device.startswith("cuda"):
            report["gpu"] = torch.cuda.get_device_name()
        print_table(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
