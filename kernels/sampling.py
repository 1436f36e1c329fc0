"""One token per row on the GPU: greedy, or temperature + top-k + top-p + min-p.

References: kernels.reference.sampling_survivors (which tokens may be drawn),
sampling_probabilities (with what probability) and sample_tokens_reference (the
exact draw, with the kernel's random stream). The cuts are value thresholds
(equal logits at a cut all survive); see the comment above those functions.

The random stream of a row is a pure function of (seed, offset, token index):
Philox-4x32-10 keyed by the seed with the offset in its counter. The engine
passes a request's seed and its number of generated tokens as the offset, so a
request's draws do not depend on the batch it shares or its row in it. Draws
use the Gumbel-max trick: argmax over the survivors of logit / T + Gumbel noise.

CUDA-graph safe: with `out` given the call allocates nothing, reads nothing
back to the host and launches one grid of N blocks.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from kernels.cuda_build import (
    check_cuda_tensor,
    launch,
    load_kernel,
    ptr,
    set_max_dynamic_shared,
)

_THREADS = 1024  # one CTA per row (kernels/csrc/sampling.cu's kThreads)
_BUCKETS = 4096  # first-level histogram: 8-byte mass + 4-byte count each
_CAPACITY = 16384  # candidates sorted in shared memory, 8 bytes each
_SHARED_BYTES = max(_BUCKETS * 12, _CAPACITY * 8)  # the two never live at once
# Token indices are int32 in the kernel, with room for its group arithmetic.
_MAX_VOCAB = 1 << 30


@functools.cache
def _kernel(device_index: int) -> Any:
    kernel = load_kernel("sampling.cu", "sample_tokens_f32", device_index)
    set_max_dynamic_shared(kernel, _SHARED_BYTES)
    return kernel


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row.

    logits: float32 [N, V] (-inf allowed where a grammar forbids a token; each
    row needs one finite value). temperature: float32 [N], a row with
    temperature <= 0 is greedy (torch.argmax: the lowest index among equal
    maxima). top_k: int32 [N] (<= 0 or >= V: off). top_p: float32 [N] (>= 1:
    off). min_p: float32 [N] (<= 0: off). seeds, offsets: int64 [N], the row's
    random stream. All contiguous on one CUDA device. Returns (or fills) int64 [N].
    """
    check_cuda_tensor("logits", logits, dtype=torch.float32, ndim=2)
    rows, vocab = logits.shape
    device = logits.device
    for name, tensor, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32),
        ("min_p", min_p, torch.float32),
        ("seeds", seeds, torch.int64),
        ("offsets", offsets, torch.int64),
    ):
        check_cuda_tensor(name, tensor, dtype=dtype, ndim=1, device=device)
        if tensor.shape[0] != rows:
            raise ValueError(f"{name} must have {rows} entries (one per row), got {tensor.shape[0]}")
    if vocab == 0 or vocab > _MAX_VOCAB:
        raise ValueError(f"logits' vocabulary size must be in [1, {_MAX_VOCAB}], got {vocab}")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=device)
    else:
        check_cuda_tensor("out", out, dtype=torch.int64, ndim=1, device=device)
        if out.shape[0] != rows:
            raise ValueError(f"out must have {rows} entries, got {out.shape[0]}")
    if rows == 0:
        return out
    launch(
        _kernel(device.index if device.index is not None else torch.cuda.current_device()),
        (rows,),
        (_THREADS,),
        (
            ptr(out),
            ptr(logits),
            ptr(temperature),
            ptr(top_k),
            ptr(top_p),
            ptr(min_p),
            ptr(seeds),
            ptr(offsets),
            np.int32(vocab),
        ),
        device,
        _SHARED_BYTES,
    )
    return out
