"""Random-weight models at real shapes for the GPU benchmarks, built straight
on the device (no checkpoint on disk), and engines around them."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import protocol as p
from engine.loader import LoadedModel
from engine.models import ModelConfig, build_model
from engine.process.bootstrap import assemble_engine
from engine.scheduling.core import EngineCore

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
