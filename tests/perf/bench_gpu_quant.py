"""Quantized weights served quantized, through the engine (issue 19's H200 benchmark).

    python tests/perf/bench_gpu_quant.py [--shapes qwen3-8b,qwen3-0.6b]
        [--formats bf16,Q8_0,Q4_K,Q4_K_M,fp8-load,fp8-block,fp8-tensor] [--tokens 64]
        [--batch 64] [--prefill 1024] [--smoke]

Random-weight Qwen3 at each shape, in one format:
- Q8_0 or Q4_K: every linear weight (q/k/v, o, gate/up, down, lm_head)
  replaced by packed GGUF blocks of that type, random bytes with small
  scales (any byte string is a valid block: the kernels' speed does not
  depend on the values);
- Q4_K_M: llama.cpp's mix of that name: Q4_K, but v and down in Q6_K in
  every other layer (llama.cpp picks the first and last eighths and every
  third layer between; half is the same byte count within a few percent)
  and the lm_head in Q6_K;
- fp8-load: the bf16 model written as a checkpoint and loaded with the
  engine's --quantize fp8 (the projections quantized to FP8 at load);
- fp8-block, fp8-tensor: the bf16 model written as an FP8 checkpoint, the
  projections in float8 e4m3 with 128x128 block scales (as Qwen3's FP8
  releases store them) or one scale per tensor, and loaded as one (the
  loader expands a per-tensor scale into the same block table, so
  fp8-tensor runs fp8-block's kernels: it checks the load path);
  in the FP8 formats lm_head, the embedding and the norms stay bf16;
- bf16: the unquantized model, the reference in the same run.
For each: the seconds to build (and write and load) the model; batch-1
decode tok/s against the roofline of the bytes a step reads in that format
(packed or FP8 linear weights with their scales, one embedding row, the
norms, the KV of the context) at the device copy rate measured in the same
run; batch-`--batch` decode tok/s; one `--prefill`-token prompt's tokens/s.
The FP8 checkpoints go to a temporary directory, removed once loaded.

--smoke runs a tiny model on the CPU (the reference ops dequantize) in
seconds (tests/test_perf_smoke.py); there the FP8 formats are loaded with
the FP8 slots forced on (the engine refuses --quantize fp8 without our CUDA
kernels and dequantizes FP8 checkpoints on the CPU). Writes
$OUT/bench_gpu_quant.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.execution.fp8_weight import Fp8Weight
from engine.execution.quantized_weight import QuantizedWeight, quantized_weights
from engine.loader import LoadedModel, load_model
from engine.models import ModelConfig, build_model
from kernels.gguf_reference import BLOCK_SIZES, row_bytes
from router.heap import freeze_long_lived
from tests.perf.bench_gpu_speculation import run_batch
from tests.perf.gpu_models import copy_bandwidth, hf_config, make_engine, write_checkpoint

Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 8, 12, 13, 14
TYPE_IDS = {"Q8_0": Q8_0, "Q4_K": Q4_K, "Q6_K": Q6_K, "Q4_0": Q4_0, "Q5_K": Q5_K}
# Byte offsets of each block's float16 scales (d, and dmin for Q4_K / Q5_K).
_SCALE_OFFSETS = {Q4_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}
# FP8 format -> the checkpoint's scales (None: a bf16 one, --quantize fp8).
FP8_FORMATS: dict[str, str | None] = {"fp8-load": None, "fp8-block": "block",
                                      "fp8-tensor": "tensor"}
TINY: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
    "tie_word_embeddings": False,
}


def random_blocks(qtype: int, rows: int, k: int, device: torch.device,
                  generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random block bytes with scales of about
    1e-3 (finite float16), so the outputs stay finite through the layers."""
    _, size = BLOCK_SIZES[qtype]
    blocks = torch.randint(0, 256, (rows, row_bytes(qtype, k) // size, size), dtype=torch.uint8,
                           device=device, generator=generator)
    for index, offset in enumerate(_SCALE_OFFSETS[qtype]):
        scale = torch.full(blocks.shape[:2], 1e-3 if index == 0 else 1e-4, dtype=torch.float16,
                           device=device)
        blocks[:, :, offset:offset + 2] = scale.view(torch.uint8).view(*blocks.shape[:2], 2)
    return blocks.view(rows, -1)


def mix_types(fmt: str, layer: int, slot: str) -> list[int] | int:
    """The GGUF type of a slot of a layer (a list for a fused slot's parts)."""
    if fmt != "Q4_K_M":
        return TYPE_IDS[fmt]
    heavy = layer % 2 == 0
    if slot == "qkv_weight":
        return [Q4_K, Q4_K, Q6_K if heavy else Q4_K]
    if slot == "down_weight":
        return Q6_K if heavy else Q4_K
    return Q4_K


@torch.inference_mode()
def quantized_model(cfg: dict[str, Any], fmt: str, device: torch.device) -> LoadedModel:
    """Random weights; with a GGUF format, every linear slot packed."""
    config = ModelConfig.from_hf_config(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(config, device, dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
    if fmt != "bf16":
        for layer_index, layer in enumerate(model.layers):
            for module in (layer.self_attn, layer.mlp):
                for slot in type(module).linear_weights:
                    _pack(module, slot, mix_types(fmt, layer_index, slot), config, device,
                          generator)
        lm_type = Q6_K if fmt == "Q4_K_M" else TYPE_IDS[fmt]
        if not config.tie_word_embeddings:
            _pack(model, "lm_head", lm_type, config, device, generator)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    n_params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return LoadedModel(config, model, n_params, nbytes)


def _pack(module: torch.nn.Module, slot: str, types: list[int] | int, config: ModelConfig,
          device: torch.device, generator: torch.Generator) -> None:
    weight = getattr(module, slot)
    rows, k = weight.shape
    if isinstance(types, int):
        parts = [(rows, types)]
    else:  # q, k, v
        parts = [(config.q_size, types[0]), (config.kv_size, types[1]), (config.kv_size, types[2])]
    packed = QuantizedWeight(parts, k, device)
    for segment in packed.segments():
        segment.packed.copy_(random_blocks(segment.qtype, segment.rows, k, device, generator))
    delattr(module, slot)
    setattr(module, slot, packed)


def fp8_model(cfg: dict[str, Any], fmt: str, device: torch.device) -> LoadedModel:
    """The random bf16 model written as a checkpoint (FP8 for fp8-block and
    fp8-tensor) and loaded by the engine's loader (fp8-load: --quantize fp8)."""
    cuda = device.type == "cuda"
    directory = Path(tempfile.mkdtemp(prefix="roundhouse-fp8-"))
    try:
        write_checkpoint(quantized_model(cfg, "bf16", device), cfg, directory, FP8_FORMATS[fmt])
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        # NOTE: on the CPU the FP8 slots must be forced on (packed_quant)
        # to run at all: the smoke then checks the load and the reference ops.
        loaded = load_model(directory, device, torch.bfloat16 if cuda else torch.float32,
                            packed_quant=None if cuda else True,
                            quantize="fp8" if fmt == "fp8-load" else None)
    finally:
        shutil.rmtree(directory)
    # q/k/v, o, gate/up and down of every layer; anything less would measure bf16.
    found = sum(isinstance(w, Fp8Weight) for w in quantized_weights(loaded.model))
    expected = 4 * len(loaded.model.layers)
    if found != expected:
        raise RuntimeError(f"{fmt}: {found} FP8 weights loaded, expected {expected} (4 a layer)")
    return loaded


def weights_bytes(model: torch.nn.Module) -> int:
    """Device bytes of the weights: float ones (a tied lm_head once), packed
    and FP8 ones as stored, with their scales."""
    return (sum(t.numel() * t.element_size() for t in model.parameters())
            + sum(weight.nbytes for weight in quantized_weights(model)))


def step_bytes(loaded: LoadedModel, context: int) -> int:
    """Bytes a batch-1 decode step reads: every weight (packed and FP8 ones
    as stored, with their scales) but the embedding, of which one row, and
    the context's KV."""
    model, config = loaded.model, loaded.config
    embed = model.embed_tokens
    total = weights_bytes(model) - embed.numel() * embed.element_size()
    total += config.hidden_size * embed.element_size()
    if config.tie_word_embeddings:
        total += embed.numel() * embed.element_size()
    return total + config.kv_bytes_per_token(torch.bfloat16) * context


def prompts_of(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def bench_format(cfg: dict[str, Any], shape: str, fmt: str, args: argparse.Namespace,
                 device: torch.device, copy_rate: float) -> list[dict[str, Any]]:
    cuda = device.type == "cuda"
    started = time.perf_counter()
    loaded = fp8_model(cfg, fmt, device) if fmt in FP8_FORMATS else quantized_model(cfg, fmt,
                                                                                   device)
    setup = {"shape": shape, "format": fmt, "section": "setup",
             "seconds": time.perf_counter() - started,
             "weights_gb": weights_bytes(loaded.model) / 1e9}
    print(json.dumps(setup), flush=True)
    rows: list[dict[str, Any]] = [setup]
    prompt_len = 128
    core, events = make_engine(loaded, device=device.type,
                               dtype="bfloat16" if cuda else "float32",
                               max_concurrency=args.batch, max_batched_tokens=max(args.prefill, 2048),
                               max_context=max(prompt_len + args.tokens, args.prefill) + 16)
    vocab = loaded.config.vocab_size
    for batch in (1, args.batch):
        prompts = prompts_of(batch, prompt_len, vocab, batch)
        run_batch(core, events, f"warm-{batch}", prompts, 4, cuda)
        prefill_s, _ = run_batch(core, events, f"prefill-{batch}", prompts, 1, cuda)
        seconds, _ = run_batch(core, events, f"decode-{batch}", prompts, args.tokens, cuda)
        decode_s = max(seconds - prefill_s, 1e-9)
        row: dict[str, Any] = {"shape": shape, "format": fmt, "section": "decode", "batch": batch,
                               "tok_s": batch * (args.tokens - 1) / decode_s}
        if batch == 1:
            nbytes = step_bytes(loaded, prompt_len + args.tokens // 2)
            row["step_gb"] = nbytes / 1e9
            if cuda:
                roofline = copy_rate / nbytes
                row.update(roofline_tok_s=roofline, of_roofline=row["tok_s"] / roofline)
        print(json.dumps(row), flush=True)
        rows.append(row)
    prompt = prompts_of(1, args.prefill, vocab, 99)
    run_batch(core, events, "warm-prefill", prompt, 1, cuda)
    seconds, _ = run_batch(core, events, "prefill", prompt, 1, cuda)
    row = {"shape": shape, "format": fmt, "section": "prefill", "tokens": args.prefill,
           "tok_s": args.prefill / seconds}
    print(json.dumps(row), flush=True)
    rows.append(row)
    del core, events, loaded
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-8b,qwen3-0.6b")
    parser.add_argument("--formats",
                        default="bf16,Q8_0,Q4_K,Q4_K_M,fp8-load,fp8-block,fp8-tensor")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    freeze_long_lived(collect_first=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    cuda = device.type == "cuda"
    shapes = args.shapes.split(",")
    if args.smoke:
        shapes, args.tokens, args.batch, args.prefill = ["tiny"], 4, 2, 32
        if any(fmt in FP8_FORMATS for fmt in args.formats.split(",")):
            print("smoke: the FP8 formats run with their FP8 slots forced on, on the torch "
                  "reference ops (the engine refuses --quantize fp8 on the CPU)", flush=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                               "device": torch.cuda.get_device_name() if cuda else "cpu",
                               "rows": []}
    copy_rate = copy_bandwidth(device) if cuda else 0.0
    results["copy_gb_s"] = copy_rate / 1e9
    for shape in shapes:
        cfg = {**hf_config("qwen3-0.6b"), **TINY} if shape == "tiny" else hf_config(shape)
        for fmt in args.formats.split(","):
            results["rows"] += bench_format(cfg, shape, fmt, args, device, copy_rate)
    if not args.smoke:
        out = Path(os.environ.get("OUT", "."))
        (out / "bench_gpu_quant.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
