"""The engine on the GPU at real shapes with random weights, against the HBM
roofline, the tensor-core peak and Hugging Face transformers, in one run.

    python tests/perf/bench_gpu_engine.py [--only decode,throughput,prefill,hf,kv-fp8,deterministic]

1. Batch-1 decode tok/s at the Qwen3-0.6B and Qwen3-8B shapes through the
   engine's own step loop (scheduler, inputs, graph replay, sampling,
   outputs), against the roofline: measured copy bandwidth over the bytes a
   step must read.
2. Offline throughput on nano-vllm's workload: 256 requests with input and
   output lengths uniform in 100..1024 (seed 0; tests/perf/nano_vllm_workload.py),
   Qwen3-0.6B shape, output tokens over the whole wall time, prefill included.
   With kv-fp8 (not in the default set): the same workload at the
   Qwen3-8B shape under a 24 GiB memory grant, --kv-dtype bf16 against fp8.
3. Time to first token for 1k, 8k and 32k-token prompts at the 8B shape, as
   prompt tok/s and as a share of the measured bf16 GEMM rate.
4. transformers (eager generate and forward, bf16, sdpa) on the same shapes.
5. With deterministic (not in the default set): batch-invariant mode's cost,
   batch-1 and batch-64 decode tok/s and a 1k-token prefill at the 0.6B and
   8B shapes, with --deterministic off and on side by side.

Prints a table last; writes every figure to $OUT/bench_gpu_engine.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from engine.scheduling.core import EngineCore
from tests.perf.gpu_models import (
    QWEN3_TEXT_VOCAB,
    copy_bandwidth,
    decode_step_bytes,
    hf_config,
    make_engine,
    matmul_flops,
    random_model,
)
from tests.perf.nano_vllm_workload import (
    drain,
    nano_vllm_requests,
    random_prompt,
    run_workload,
    submit,
)

DEVICE = torch.device("cuda")
RESULTS: dict[str, Any] = {}


# The memory grant of the kv-fp8 comparison: the 8B shape's 16.4 GB of
# weights, its workspace and graphs, and about 6 GB of KV in bf16.
KV_GRANT_MIB = 24 * 1024


def _free(*objects: object) -> None:
    del objects
    gc.collect()
    torch.cuda.empty_cache()


def bench_decode(shape: str) -> dict[str, float]:
    loaded = random_model(shape, DEVICE)
    core, events = make_engine(loaded, max_concurrency=8, max_batched_tokens=2048,
                               max_context=4096, kv_capacity_tokens=65536)
    rng = random.Random(1)
    submit(core, "warm", random_prompt(rng, 64), 64)
    drain(core)
    submit(core, "solo", random_prompt(rng, 32), 513)
    stamps = []
    while core.has_work:
        core.step()
        stamps.append(time.perf_counter())
    # The loop runs one step ahead: turn 1 launches the prefill, turn 2
    # completes it (the first token) with decode step 1 launched, and the
    # last turn completes decode step 512.
    tok_s = 512 / (stamps[-1] - stamps[1])
    step_bytes = decode_step_bytes(loaded)
    roofline = RESULTS["copy_bandwidth_Bps"] / step_bytes
    _free(core, events, loaded)
    return {"tok_s": tok_s, "roofline_tok_s": roofline, "share": tok_s / roofline,
            "step_bytes": step_bytes}


def bench_throughput(shape: str = "qwen3-0.6b", **options: Any) -> dict[str, float]:
    """nano-vllm's workload; options: engine options (a KV dtype, a memory grant)."""
    loaded = random_model(shape, DEVICE)
    core, events = make_engine(loaded, max_concurrency=256, max_batched_tokens=16384,
                               max_context=4096, **options)
    result = {**run_workload(core, nano_vllm_requests()), **options}
    _free(core, events, loaded)
    return result


def _prefill_flops(shape: str, tokens: int) -> float:
    cfg = hf_config(shape)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per_layer = hidden * (heads + 2 * kv) * dim + heads * dim * hidden + \
        3 * hidden * cfg["intermediate_size"]
    linear = 2 * layers * per_layer * tokens + 2 * hidden * cfg["vocab_size"]
    attention = 4 * layers * heads * dim * tokens * (tokens + 1) / 2
    return linear + attention


def bench_prefill() -> dict[str, dict[str, float]]:
    loaded = random_model("qwen3-8b", DEVICE)
    core, events = make_engine(loaded, max_concurrency=8, max_batched_tokens=8192,
                               max_context=40960)
    rng = random.Random(2)
    submit(core, "warm", random_prompt(rng, 1024), 1)
    drain(core)
    results = {}
    for length in (1024, 8192, 32768):
        prompt = random_prompt(rng, length)
        torch.cuda.synchronize()
        started = time.perf_counter()
        submit(core, f"p{length}", prompt, 1)
        drain(core)
        ttft = time.perf_counter() - started
        flops = _prefill_flops("qwen3-8b", length)
        results[str(length)] = {"ttft_s": ttft, "tok_s": length / ttft,
                                "tflops": flops / ttft / 1e12,
                                "share_of_gemm_peak": flops / ttft / RESULTS["gemm_flops"]}
    _free(core, events, loaded)
    return results


def _decode_rate(core: EngineCore, batch: int, rng: random.Random, steps: int = 256) -> float:
    """Output tok/s of `batch` requests decoding together, their 32-token
    prompts prefilled in one step before the clock starts."""
    for index in range(batch):
        submit(core, f"b{batch}-{index}", random_prompt(rng, 32), steps + 1)
    stamps = []
    while core.has_work:
        core.step()
        stamps.append(time.perf_counter())
    # As bench_decode: turn 2 completes the prefill (every first token), the
    # last turn completes decode step `steps`.
    return batch * steps / (stamps[-1] - stamps[1])


def _prefill_rate(core: EngineCore, length: int, rng: random.Random) -> float:
    """Prompt tok/s of one `length`-token prompt (time to its first token)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    submit(core, f"p{length}", random_prompt(rng, length), 1)
    drain(core)
    return length / (time.perf_counter() - started)


def bench_deterministic() -> dict[str, dict[str, dict[str, float]]]:
    """Batch-invariant mode (--deterministic) against the default, per shape."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    for shape in ("qwen3-0.6b", "qwen3-8b"):
        loaded = random_model(shape, DEVICE)
        results[shape] = {}
        for deterministic in (False, True):
            core, events = make_engine(loaded, max_concurrency=64, max_batched_tokens=2048,
                                       max_context=2048, deterministic=deterministic)
            rng = random.Random(3)
            submit(core, "warm", random_prompt(rng, 1024), 16)
            drain(core)
            row = {"decode_b1_tok_s": _decode_rate(core, 1, rng),
                   "decode_b64_tok_s": _decode_rate(core, 64, rng),
                   "prefill_1k_tok_s": _prefill_rate(core, 1024, rng)}
            results[shape]["on" if deterministic else "off"] = row
            print(json.dumps({shape: {"deterministic": deterministic, **row}}), flush=True)
            _free(core, events)
        _free(loaded)
    return results


def bench_transformers() -> dict[str, Any]:
    import transformers

    results: dict[str, Any] = {}
    for shape in ("qwen3-0.6b", "qwen3-8b"):
        config = transformers.Qwen3Config(**{k: v for k, v in hf_config(shape).items()
                                             if k not in ("architectures", "torch_dtype")})
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(DEVICE):
            model = transformers.Qwen3ForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
        prompt = torch.randint(0, QWEN3_TEXT_VOCAB, (1, 32), device=DEVICE)
        with torch.inference_mode():
            model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            torch.cuda.synchronize()
            started = time.perf_counter()
            model.generate(prompt, max_new_tokens=128, min_new_tokens=128, do_sample=False)
            torch.cuda.synchronize()
            entry: dict[str, Any] = {"decode_tok_s": 128 / (time.perf_counter() - started)}
            if shape == "qwen3-8b":
                for length in (1024, 8192, 32768):
                    ids = torch.randint(0, QWEN3_TEXT_VOCAB, (1, length), device=DEVICE)
                    model(ids[:, :128], logits_to_keep=1)
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    model(ids, logits_to_keep=1)
                    torch.cuda.synchronize()
                    seconds = time.perf_counter() - started
                    entry[f"prefill_{length}"] = {"ttft_s": seconds, "tok_s": length / seconds}
        results[shape] = entry
        _free(model)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="decode,throughput,prefill,hf")
    parts = set(parser.parse_args().only.split(","))
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["date"] = time.strftime("%Y-%m-%d")
    RESULTS["copy_bandwidth_Bps"] = copy_bandwidth(DEVICE)
    RESULTS["gemm_flops"] = matmul_flops(DEVICE)
    if "decode" in parts:
        RESULTS["decode"] = {shape: bench_decode(shape) for shape in ("qwen3-0.6b", "qwen3-8b")}
        print(json.dumps(RESULTS["decode"]), flush=True)
    if "throughput" in parts:
        RESULTS["throughput"] = bench_throughput()
        print(json.dumps(RESULTS["throughput"]), flush=True)
    if "kv-fp8" in parts:
        # The 8B shape on a memory grant where the bf16 KV cannot hold the
        # whole workload at once (about a 24 GB card's room beside the
        # weights): fp8 KV holds twice the tokens.
        RESULTS["kv_fp8"] = [bench_throughput("qwen3-8b", kv_dtype=kv, device_memory_mib=KV_GRANT_MIB)
                             for kv in ("bf16", "fp8")]
        print(json.dumps(RESULTS["kv_fp8"]), flush=True)
    if "prefill" in parts:
        RESULTS["prefill"] = bench_prefill()
        print(json.dumps(RESULTS["prefill"]), flush=True)
    if "deterministic" in parts:
        RESULTS["deterministic"] = bench_deterministic()
    if "hf" in parts:
        RESULTS["transformers"] = bench_transformers()
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_gpu_engine.json").write_text(json.dumps(RESULTS, indent=2))
    print(f"\n{RESULTS['device']}: copy {RESULTS['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
          f"bf16 GEMM {RESULTS['gemm_flops'] / 1e12:.0f} TFLOP/s")
    for shape, row in RESULTS.get("decode", {}).items():
        hf = RESULTS.get("transformers", {}).get(shape, {}).get("decode_tok_s", float("nan"))
        print(f"decode b=1 {shape}: {row['tok_s']:.0f} tok/s = {row['share']:.0%} of roofline "
              f"{row['roofline_tok_s']:.0f}; transformers {hf:.1f} tok/s")
    if "throughput" in RESULTS:
        row = RESULTS["throughput"]
        print(f"throughput 256 req 0.6b: {row['output_tok_s']:.0f} output tok/s "
              f"({row['seconds']:.1f} s, {row['preemptions']} preemptions)")
    for shape, modes in RESULTS.get("deterministic", {}).items():
        for metric in ("decode_b1_tok_s", "decode_b64_tok_s", "prefill_1k_tok_s"):
            off, on = modes["off"][metric], modes["on"][metric]
            print(f"--deterministic {shape} {metric}: off {off:.0f}, on {on:.0f} "
                  f"({on / off:.0%} of off)")
    for length, row in RESULTS.get("prefill", {}).items():
        hf = RESULTS.get("transformers", {}).get("qwen3-8b", {}).get(f"prefill_{length}", {})
        print(f"prefill 8b {length}: TTFT {row['ttft_s'] * 1e3:.0f} ms, {row['tok_s']:.0f} tok/s, "
              f"{row['tflops']:.0f} TFLOP/s = {row['share_of_gemm_peak']:.0%} of GEMM peak; "
              f"transformers {hf.get('ttft_s', float('nan')) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
