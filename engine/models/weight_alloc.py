"""Where a model's weights are allocated while it is built.

Models allocate every weight empty on the target device and the loaders fill
it in place. A load that keeps some matrices in their quantized GGUF blocks
(engine/loader/packing.py) must not allocate the float matrices it will never
fill: inside deferred_weights() the weights are allocated on the meta device
(no memory), and the loader then allocates each one it fills, or puts a
QuantizedWeight in its slot. Buffers computed at build (the rotary tables)
and the host-resident experts are allocated as always.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

_DEFERRED: ContextVar[bool] = ContextVar("deferred_weights", default=False)


@contextmanager
def deferred_weights() -> Iterator[None]:
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def empty_weight(shape: tuple[int, ...], device: torch.device | str,
                 dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized weight on device (on the meta device while deferred)."""
    where = "meta" if _DEFERRED.get() else device
    return nn.Parameter(torch.empty(shape, device=where, dtype=dtype), requires_grad=False)
