"""What the engine's CUDA graphs share: one memory pool and the logits buffer.

Decode graphs (engine/execution/cuda_graphs.py) and graphs of steps with
prompt chunks (engine/execution/chunk_graphs.py) capture into one pool,
largest first, so a smaller graph's intermediates fit in what a larger one
left free: no two graphs run at once, and every graph's result leaves it
through `logits`, a buffer outside the pool (a graph's own output would stay
allocated). Sampling reads the logits before the next graph is replayed: the
engine launches a step's sampling before the next step's forward pass.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


class GraphMemory:
    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        # float32 logits of up to `rows` rows, written by each replay.
        self.logits = torch.empty((rows, vocab_size), dtype=torch.float32, device=device)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collect garbage first and none while the body runs: Python's collector
    may free CUDA objects of something dead (another engine's graphs or
    events, in a process that builds several) in the middle of a capture,
    and CUDA then refuses the capture."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
