"""Mixture-of-experts decode through the engine (issue 17's H200 benchmark):
random weights at the Qwen3-30B-A3B shape, bf16, experts on the device and
in host memory.

    python tests/perf/bench_gpu_moe_decode.py [--batches 1,32] [--tokens 128]
        [--host-layers 12] [--expert-cache-mib 0] [--smoke]

Device-resident: decode tok/s at each batch size, against the roofline of
the bytes a batch-1 step reads (every weight outside the routed experts, the
8 active experts of each layer, the lm_head; the KV of a 128-token prompt is
noise), at the device copy rate measured in the same run.

Host-resident (--expert-residency host): the same at a cut of the shape to
--host-layers layers (the full 48 layers' experts, 58 GB, take minutes to
pin and fill), against the page-locked host-to-device copy rate measured in
the same run: a batch-1 step reads its active experts over the bus. With
--expert-cache-mib, hot experts are read from a device cache instead.

--smoke runs a tiny MoE on the CPU in seconds (tests/test_perf_smoke.py).
Writes $OUT/bench_gpu_moe_decode.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.loader import LoadedModel
from engine.models import ModelConfig, build_model
from engine.models.moe import SparseMoE
from router.heap import freeze_long_lived
from tests.perf.bench_gpu_speculation import PROMPT_TOKENS, run_batch
from tests.perf.gpu_models import QWEN3_COMMON, copy_bandwidth, make_engine

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
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--host-layers", type=int, default=12)
    parser.add_argument("--expert-cache-mib", type=int, default=0)
    parser.add_argument("--skip-device", action="store_true")
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
    if not args.skip_device:
        loaded = moe_model(cfg, device, dtype, host_experts=False)
        step_bytes = active_step_bytes(loaded)
        for row in decode_rows(loaded, args, device, "device"):
            if cuda and row["batch"] == 1:
                roofline = results["copy_gb_s"] * 1e9 / step_bytes
                row.update(step_gb=step_bytes / 1e9, roofline_tok_s=roofline,
                           of_roofline=row["tok_s"] / roofline)
                print(f"  batch 1: {step_bytes / 1e9:.2f} GB a step, roofline "
                      f"{roofline:,.0f} tok/s: {row['of_roofline']:.0%}", flush=True)
            results["rows"].append(row)
        del loaded
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
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
        out = Path(os.environ.get("OUT", "."))
        (out / "bench_gpu_moe_decode.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
