"""Random-weight models at real shapes for the GPU benchmarks, built straight
on the device (no checkpoint on disk), and engines around them; write_checkpoint
puts one on disk as a Hugging Face checkpoint (bf16, or FP8 as Qwen3's FP8
releases store it) for the benchmarks that load through the engine's loader."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import protocol as p
from engine.loader import LoadedModel
from engine.models import ModelConfig, build_model
from engine.process.bootstrap import assemble_engine
from engine.scheduling.core import EngineCore
from kernels.fp8_reference import E4M3_MAX, FP8, quantize_blocks

QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    "head_dim": 128, "num_key_value_heads": 8, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
    # For the benchmarks' CPU smoke runs: the same code paths, seconds of work.
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "head_dim": 16, "num_key_value_heads": 2,
             "tie_word_embeddings": True},
}
# The tokens of Qwen3's tokenizer (its embedding has spare rows past these).
QWEN3_TEXT_VOCAB = 151669
# What an FP8 checkpoint stores in float8 e4m3; Qwen3's FP8 releases keep the
# embedding, the norms and lm_head in bf16.
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# write_checkpoint's shard size: the host holds one shard at a time.
SHARD_BYTES = 2 << 30


def hf_config(shape: str) -> dict[str, Any]:
    return {**QWEN3_COMMON, **SHAPES[shape]}


@torch.inference_mode()
def random_model(shape: str, device: torch.device, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    config = ModelConfig.from_hf_config(hf_config(shape))
    model = build_model(config, device, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
    n_params = sum(param.numel() for param in model.parameters())
    return LoadedModel(config, model, n_params, n_params * dtype.itemsize)


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of the weights (parameters() yields a tied lm_head once)."""
    return sum(param.numel() * param.element_size() for param in loaded.model.parameters())


def decode_step_bytes(loaded: LoadedModel) -> int:
    """Bytes a batch-1 decode step must read: every weight once, except that
    the embedding reads one row (unless it is also the lm_head)."""
    config = loaded.config
    embed = config.vocab_size * config.hidden_size * 2
    total = weight_bytes(loaded)
    return total if config.tie_word_embeddings else total - embed


@torch.inference_mode()
def write_checkpoint(loaded: LoadedModel, hf: dict[str, Any], target: Path,
                     fp8_scales: str | None = None) -> Path:
    """loaded's weights as a Hugging Face checkpoint in target: config.json
    (hf) and bf16 safetensors shards. fp8_scales "block" or "tensor": the
    projections in float8 e4m3 with 128x128 block scales (weight_scale_inv)
    or one scale per tensor (weight_scale), quantization_config saying so."""
    target.mkdir(parents=True, exist_ok=True)
    if fp8_scales is not None:
        block = {"weight_block_size": [128, 128]} if fp8_scales == "block" else {}
        hf = {**hf, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "modules_to_not_convert": ["lm_head"], **block}}
    (target / "config.json").write_text(json.dumps(hf))
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = files = 0
    for name, weight in loaded.model.weight_destinations(stacked_experts=False).items():
        # A weight and its scale go to the same shard.
        for key, tensor in _stored(name, weight, fp8_scales).items():
            shard[key] = tensor.to("cpu", copy=True).contiguous()
            shard_bytes += shard[key].nbytes
        if shard_bytes >= SHARD_BYTES:
            files += 1
            save_file(shard, str(target / f"model-{files:05d}.safetensors"))
            shard, shard_bytes = {}, 0
    if shard:
        save_file(shard, str(target / f"model-{files + 1:05d}.safetensors"))
    return target


def _stored(name: str, weight: torch.Tensor, fp8_scales: str | None) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores for one weight (quantized on its device)."""
    if fp8_scales is None or name.rsplit(".", 2)[-2] not in FP8_PROJECTIONS:
        return {name: weight.to(torch.bfloat16)}
    base = name.removesuffix("weight")
    if fp8_scales == "block":
        values, scales = quantize_blocks(weight)
        return {name: values, base + "weight_scale_inv": scales}
    scale = weight.abs().max().float() / E4M3_MAX
    values = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return {name: values, base + "weight_scale": scale}


def make_engine(loaded: LoadedModel, device: str = "cuda", dtype: str = "bfloat16",
                **options: Any) -> tuple[EngineCore, list[p.EngineEvent]]:
    events: list[p.EngineEvent] = []
    marker = Path(tempfile.mkdtemp(prefix="roundhouse-bench-")) / "config.json"
    marker.write_text(json.dumps(hf_config("qwen3-0.6b")))
    launch = p.EngineOptions(device=device, dtype=dtype, **options)
    core, _ = assemble_engine(loaded, marker, launch, lambda fraction, message: None,
                              events.append)
    return core, events


def graph_time_us(calls: list[Callable[[], object]], replays: int = 25,
                  warm_replays: int = 1) -> float:
    """Median device time of one call, from replays of a CUDA graph of all
    the calls (the calls run once eagerly first: compiling, warming caches
    and the allocator outside the capture)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(warm_replays):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / len(calls)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[len(times) // 2]


def matmul_flops(device: torch.device, n: int = 8192) -> float:
    """bf16 GEMM rate through cuBLAS on random data, FLOP/s."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize(device)
    return 10 * 2 * n**3 / (time.perf_counter() - started)
