"""The engine's settings, validated once; measured values never written back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    device: str = "cpu"
    # "auto" picks float32 on the CPU (fast there, and exact against the
    # reference) and bfloat16 on CUDA.
    dtype: str = "auto"
    page_size: int = 16
    # Lanes: requests decoded together. Further requests wait in FIFO order.
    max_concurrency: int = 8
    # Tokens one step may compute: all decode rows plus prefill chunks.
    max_batched_tokens: int = 512
    # 0 means the model's trained context.
    max_context: int = 0
    # KV pool size in tokens; 0 means sized automatically (engine/kv_sizing.py).
    kv_capacity_tokens: int = 0
    # Admission reserves KV for the prompt plus up to this many output tokens,
    # so admitted requests rarely need to be preempted.
    output_window: int = 256
    threads: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.max_batched_tokens < self.max_concurrency:
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must be at least "
                f"max_concurrency ({self.max_concurrency}) so every lane can decode each step"
            )
        if self.max_context < 0 or self.kv_capacity_tokens < 0 or self.output_window < 0:
            raise ValueError("max_context, kv_capacity_tokens and output_window must be >= 0")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")
