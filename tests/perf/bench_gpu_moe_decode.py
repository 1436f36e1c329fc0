"""Mixture-of-experts decode through the engine (issue 17's H200 benchmark):
random weights at the Qwen3-30B-A3B shape, bf16, experts on the device and
in host memory, nano-vllm's workload, and transformers at the same shape.

    python tests/perf/bench_gpu_moe_decode.py [--batches 1,32] [--tokens 128]
        [--host-layers 12] [--expert-cache-mib 0] [--no-workload]
        [--no-transformers] [--skip-device] [--smoke]

Device-resident: decode tok/s at each batch size, against the roofline of
the bytes a batch-1 step reads (every weight outside the routed experts, the
8 active experts of each layer, the lm_head; the KV of a 128-token prompt is
noise), at the device copy rate measured in the same run.

Host-resident (--expert-residency host): the same at a cut of the shape to
--host-layers layers (the full 48 layers' experts, 58 GB, take minutes to
pin and fill), against the page-locked host-to-device copy rate measured in
the same run: a batch-1 step reads its active experts over the bus. With
--expert-cache-mib, hot experts are read from a device cache instead.

Workload (--no-workload skips it): nano-vllm's offline benchmark
(tests/perf/nano_vllm_workload.py: 256 requests, input and output lengths
uniform in 100..1024, seed 0) through the engine at the device-resident
shape, as bench_gpu_engine.py runs it at the dense shapes (256 lanes, 16,384
tokens a step): output tok/s over the whole wall time, prefill included,
and the preemptions. The KV pool holds the whole workload at once (27 GiB
beside the 57 GiB of weights).

transformers (--no-transformers skips it): its Qwen3MoeForCausalLM built
from the same config at the same shape, bf16, random weights, once ours are
freed (both do not fit at once): batch-1 greedy decode tok/s through
generate (dynamic cache) over --tokens tokens after a warm-up, its prefill
timed apart and taken off as ours is, and ours over it. A transformers that
cannot build the shape is reported as such, in the output and the JSON.

The device-resident sections run first, then transformers, then the
host-resident one. --smoke runs a tiny MoE on the CPU in seconds, every
section but the host-resident one (tests/test_perf_smoke.py). Writes
$OUT/bench_gpu_moe_decode.json after each section (with --smoke only when
$OUT is set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import protocol as p
from engine.loader import LoadedModel
from engine.models import ModelConfig, build_model
from engine.models.moe import SparseMoE
from router.heap import freeze_long_lived
from tests.perf.bench_gpu_speculation import PROMPT_TOKENS, run_batch
from tests.perf.gpu_models import QWEN3_COMMON, QWEN3_TEXT_VOCAB, copy_bandwidth, make_engine
from tests.perf.nano_vllm_workload import kv_tokens_needed, nano_vllm_requests, run_workload

QWEN3_30B_A3B: dict[str, Any] = {
    **QWEN3_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
}
TINY_MOE: dict[str, Any] = {
    **QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
}
# bench_gpu_engine.py's engine for nano-vllm's workload.
WORKLOAD_ENGINE: dict[str, int] = {"max_concurrency": 256, "max_batched_tokens": 16384,
                                   "max_context": 4096}


@torch.inference_mode()
def moe_model(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype,
              host_experts: bool) -> LoadedModel:
    config = ModelConfig.from_hf_config(cfg)
    model = build_model(config, device, dtype, host_expert_layers=-1 if host_experts else 0)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        elif param.device == device:
            param.normal_(0.0, 0.02, generator=generator)
        else:
            # Host-resident stacks: one expert's random block copied into every
            # expert (filling tens of GB on the host would take minutes).
            block = torch.empty(param.shape[1:], dtype=dtype, device=device)
            block.normal_(0.0, 0.02, generator=generator)
            for expert in range(param.shape[0]):
                param[expert].copy_(block, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    n_params = sum(param.numel() for param in model.parameters())
    return LoadedModel(config, model, n_params, n_params * dtype.itemsize)


def active_step_bytes(loaded: LoadedModel) -> int:
    """Bytes a batch-1 decode step reads: every weight but the embedding (one
    row) and the routed experts, of which each layer reads experts_per_token."""
    total = 0
    for name, param in loaded.model.named_parameters():
        if name.endswith(("gate_up_weight", "down_weight")):
            continue
        if "embed_tokens" in name and not loaded.config.tie_word_embeddings:
            continue
        total += param.numel() * param.element_size()
    for module in loaded.model.modules():
        if isinstance(module, SparseMoE):
            per_expert = module.gate_up_weight[0].numel() + module.down_weight[0].numel()
            total += module.moe.experts_per_token * per_expert * module.gate_up_weight.element_size()
    return total


def pinned_copy_rate(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Host-to-device bytes/s from page-locked memory."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 5 * nbytes / (time.perf_counter() - started)


def decode_rows(loaded: LoadedModel, args: argparse.Namespace, device: torch.device,
                label: str, **options: Any) -> list[dict[str, Any]]:
    cuda = device.type == "cuda"
    max_batch = max(args.batches)
    core, events = make_engine(loaded, device=device.type,
                               dtype="bfloat16" if cuda else "float32",
                               max_concurrency=max_batch, max_batched_tokens=4096,
                               max_context=PROMPT_TOKENS + args.tokens + 16, **options)
    rng = random.Random(0)
    vocab = min(loaded.config.vocab_size, 151669)
    rows = []
    for batch in args.batches:
        prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
        run_batch(core, events, f"warm-{label}-{batch}", prompts, 16, cuda)
        # Decode time alone: the prompts' prefill timed apart and taken off.
        prefill_s, _ = run_batch(core, events, f"prefill-{label}-{batch}", prompts, 1, cuda)
        seconds, _ = run_batch(core, events, f"{label}-{batch}", prompts, args.tokens, cuda)
        decode_s = max(seconds - prefill_s, 1e-9)
        tok_s = batch * (args.tokens - 1) / decode_s
        rows.append({"config": label, "batch": batch, "tok_s": tok_s,
                     "step_ms": 1000 * decode_s / (args.tokens - 1)})
        print(f"{label} batch {batch}: {tok_s:,.1f} tok/s ({rows[-1]['step_ms']:.2f} ms/step)",
              flush=True)
    del core, events
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # the next engine sizes itself from the free memory
    return rows


def workload_figures(loaded: LoadedModel, args: argparse.Namespace,
                     device: torch.device) -> dict[str, Any]:
    """nano-vllm's workload through the engine (a few short requests in a smoke run)."""
    cuda = device.type == "cuda"
    requests = nano_vllm_requests(4, (8, 24)) if args.smoke else nano_vllm_requests()
    page_size = p.EngineOptions().page_size
    # The whole workload's KV at once, and a context for the warm-up: no
    # preemption needed, as on the dense shapes, and a fixed size rather than
    # what the device has free beside the weights.
    kv_tokens = kv_tokens_needed(requests, page_size) + WORKLOAD_ENGINE["max_context"]
    core, _ = make_engine(loaded, device=device.type, dtype="bfloat16" if cuda else "float32",
                          kv_capacity_tokens=kv_tokens, **WORKLOAD_ENGINE)
    result = {"config": "device", **run_workload(core, requests), **WORKLOAD_ENGINE}
    kv_bytes = result["kv_pages"] * page_size * loaded.config.kv_bytes_per_token(
        torch.bfloat16 if cuda else torch.float32)
    result["kv_gib"] = kv_bytes / 2**30
    print(f"workload, {result['requests']} requests: {result['output_tok_s']:,.1f} output tok/s "
          f"({result['output_tokens']:,} tokens in {result['seconds']:.1f} s, prefill included; "
          f"{result['preemptions']} preemptions; KV {result['kv_gib']:.1f} GiB)", flush=True)
    del core
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def transformers_figures(cfg: dict[str, Any], args: argparse.Namespace,
                         device: torch.device) -> dict[str, Any]:
    """transformers' Qwen3MoeForCausalLM from the same config: batch-1 greedy
    decode through generate, its prefill timed apart and taken off."""
    try:
        import transformers
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError as exc:
        return {"available": False, "error": f"no Qwen3MoeForCausalLM in transformers: {exc}"}
    freeze_long_lived(collect_first=True)  # the import makes as many objects as all the others
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    result: dict[str, Any] = {"available": True, "version": transformers.__version__,
                              "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS,
                              "cache": "dynamic"}
    if cuda:
        # What ours left behind; more than a few GiB and the build runs out of memory.
        result["allocated_before_gib"] = torch.cuda.memory_allocated(device) / 2**30
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.set_default_dtype(dtype)  # built in bf16 directly: 61 GB, not 122 in float32 first
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)).eval()
    except Exception as exc:  # a transformers that cannot build the shape is a finding
        return {**result, "available": False,
                "error": f"transformers {transformers.__version__} cannot build "
                         f"Qwen3MoeForCausalLM at this shape: {type(exc).__name__}: {exc}"}
    finally:
        torch.set_default_dtype(torch.float32)
    result["params"] = sum(param.numel() for param in model.parameters())
    result["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    rng = random.Random(4)
    ids = torch.tensor([[rng.randrange(min(cfg["vocab_size"], QWEN3_TEXT_VOCAB))
                         for _ in range(PROMPT_TOKENS)]], device=device)
    with torch.inference_mode():
        generate_seconds(model, ids, 8, cfg["eos_token_id"])  # warm: kernels, the allocator
        prefill_s = generate_seconds(model, ids, 1, cfg["eos_token_id"])
        seconds = generate_seconds(model, ids, args.tokens, cfg["eos_token_id"])
    decode_s = max(seconds - prefill_s, 1e-9)
    result.update(decode_tok_s=(args.tokens - 1) / decode_s,
                  step_ms=1000 * decode_s / (args.tokens - 1), prefill_s=prefill_s)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def generate_seconds(model: Any, ids: torch.Tensor, tokens: int, eos: int) -> float:
    """Seconds transformers' generate takes for exactly `tokens` greedy tokens."""
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(ids.device)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=eos)
    if cuda:
        torch.cuda.synchronize(ids.device)
    seconds = time.perf_counter() - started
    if out.shape[1] != ids.shape[1] + tokens:
        raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, not {tokens}")
    return seconds


def run_section(results: dict[str, Any], name: str, args: argparse.Namespace,
                measure: Callable[[], dict[str, Any]]) -> None:
    """results[name] = measure(), then the JSON written. On the GPU a failure
    is recorded and the run goes on to the next section (device time is
    scarce); a smoke run raises it."""
    started = time.perf_counter()
    try:
        results[name] = measure()
    except Exception as exc:
        if args.smoke:
            raise
        traceback.print_exc()
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: failed: {results[name]['error']}", flush=True)
    # Here, past the except block, the traceback and the frames it held (a
    # model, an engine) are gone: their device memory goes back.
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    results[name]["section_s"] = time.perf_counter() - started
    save(results, args)


def save(results: dict[str, Any], args: argparse.Namespace) -> None:
    out = os.environ.get("OUT")
    if out is None and args.smoke:
        return  # (a smoke run's figures mean nothing; tests pass $OUT to check the JSON)
    Path(out or ".", "bench_gpu_moe_decode.json").write_text(json.dumps(results, indent=2))


def compare(results: dict[str, Any]) -> None:
    """Ours over transformers at batch 1, device-resident, printed and kept."""
    hf = results["transformers"]
    if "decode_tok_s" not in hf:
        print(f"transformers: not measured: {hf.get('error')}", flush=True)
        return
    ours = next((row["tok_s"] for row in results["rows"]
                 if row["config"] == "device" and row["batch"] == 1), None)
    hf["ours_tok_s"] = ours
    hf["ours_over_transformers"] = ours / hf["decode_tok_s"] if ours else None
    if "params" in results:  # the same shape: the same parameter count
        hf["same_params"] = hf["params"] == results["params"]
    versus = (f"; ours {ours:,.1f} tok/s = {hf['ours_over_transformers']:.1f}x" if ours
              else "; ours not measured (batch 1 of --batches, without --skip-device)")
    print(f"transformers {hf['version']} batch 1 ({hf['experts_implementation']} experts, "
          f"{hf['attn_implementation']}): {hf['decode_tok_s']:,.2f} tok/s "
          f"({hf['step_ms']:.1f} ms/step){versus}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--host-layers", type=int, default=12)
    parser.add_argument("--expert-cache-mib", type=int, default=0)
    parser.add_argument("--skip-device", action="store_true",
                        help="no device-resident decode rows")
    parser.add_argument("--workload", action=argparse.BooleanOptionalAction, default=True,
                        help="nano-vllm's workload, device-resident (default: on)")
    parser.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                        help="transformers' batch-1 decode at the same shape (default: on)")
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    freeze_long_lived(collect_first=True)
    args.batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cpu" if args.smoke else "cuda")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = TINY_MOE if args.smoke else QWEN3_30B_A3B
    if args.smoke:
        args.batches, args.tokens = [1, 2], 6
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                               "device": torch.cuda.get_device_name() if cuda else "cpu",
                               "rows": []}
    if cuda:
        results["copy_gb_s"] = copy_bandwidth(device) / 1e9
        results["pinned_h2d_gb_s"] = pinned_copy_rate(device) / 1e9
        print(f"device copy {results['copy_gb_s']:,.0f} GB/s (read + written), pinned "
              f"host-to-device {results['pinned_h2d_gb_s']:,.1f} GB/s", flush=True)
    if not args.skip_device or args.workload:
        loaded = moe_model(cfg, device, dtype, host_experts=False)
        results["params"] = loaded.n_params
        step_bytes = active_step_bytes(loaded)
        for row in [] if args.skip_device else decode_rows(loaded, args, device, "device"):
            if cuda and row["batch"] == 1:
                roofline = results["copy_gb_s"] * 1e9 / step_bytes
                row.update(step_gb=step_bytes / 1e9, roofline_tok_s=roofline,
                           of_roofline=row["tok_s"] / roofline)
                print(f"  batch 1: {step_bytes / 1e9:.2f} GB a step, roofline "
                      f"{roofline:,.0f} tok/s: {row['of_roofline']:.0%}", flush=True)
            results["rows"].append(row)
        save(results, args)
        if args.workload:
            run_section(results, "workload", args, lambda: workload_figures(loaded, args, device))
        del loaded
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if args.transformers:
        # After ours is freed: the two models do not fit one H200 together.
        run_section(results, "transformers", args, lambda: transformers_figures(cfg, args, device))
        compare(results)
        save(results, args)
    if cuda:
        host_cfg = {**cfg, "num_hidden_layers": args.host_layers}
        loaded = moe_model(host_cfg, device, dtype, host_experts=True)
        bus_bytes = sum(
            m.moe.experts_per_token * (m.gate_up_weight[0].numel() + m.down_weight[0].numel()) * 2
            for m in loaded.model.modules() if isinstance(m, SparseMoE))
        options = {"expert_residency": "host", "expert_cache_mib": args.expert_cache_mib}
        label = f"host, {args.host_layers} layers" + (
            f", cache {args.expert_cache_mib} MiB" if args.expert_cache_mib else "")
        # make_engine takes the loaded model as it is: its residency is the build's.
        for row in decode_rows(loaded, args, device, label, **options):
            if row["batch"] == 1:
                bound = results["pinned_h2d_gb_s"] * 1e9 / bus_bytes
                row.update(bus_gb_per_step=bus_bytes / 1e9, bus_bound_tok_s=bound,
                           of_bus_bound=row["tok_s"] / bound)
                print(f"  batch 1: {bus_bytes / 1e9:.2f} GB of active experts a step over the "
                      f"bus, bound {bound:,.1f} tok/s: {row['of_bus_bound']:.0%}", flush=True)
            results["rows"].append(row)
        save(results, args)
    # Frozen objects outlive the exit's collection: triton's nanobind
    # bindings (imported with transformers' model) would report them as leaks.
    gc.unfreeze()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
