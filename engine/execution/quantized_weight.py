"""A linear layer's weight kept in its GGUF quantized blocks (issue 19).

A QuantizedWeight stands in a model's weight slot (qkv_weight, o_weight,
gate_up_weight, down_weight, lm_head, ...) in place of a float Parameter
[N, K]. It holds the rows as one or more segments, each a run of rows in one
GGUF type: a fused qkv of a Q4_K_M file has q and k in Q4_K and v in Q6_K.
Each segment is a uint8 buffer [rows, row_bytes], the file's block bytes, so
the device holds about the file's bytes for the matrix, and the model's
named_buffers() walk reaches it: sleep, wake and the memory ledger
(engine/execution/device_state.py, engine/process/bootstrap.py) handle it as
any other tensor.

The ops (engine/execution/model_ops.py) multiply by it: the reference ops by
dequantizing (kernels/gguf_reference.py), CudaOps with the packed kernels
(kernels/gguf_quant.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.execution.fp8_weight import Fp8Weight
from kernels.gguf_reference import BLOCK_SIZES, TYPE_NAMES, dequantize, row_bytes

# The GGUF types served packed (gguf.GGMLQuantizationType ids).
PACKED_TYPES = frozenset(BLOCK_SIZES)


@dataclass(frozen=True)
class Segment:
    """Rows [start, start + rows) of the matrix, stored in one GGUF type."""

    start: int
    rows: int
    qtype: int
    packed: torch.Tensor  # uint8 [rows, row_bytes(qtype, k)]


class QuantizedWeight(nn.Module):
    """A weight [N, K] as packed GGUF blocks, in segments of rows."""

    def __init__(self, parts: Sequence[tuple[int, int]], k: int,
                 device: torch.device | str) -> None:
        """parts: (rows, GGUF type id) of each segment, top to bottom; the
        buffers are allocated empty on device, for the loader to fill."""
        super().__init__()
        assert parts, "a quantized weight has at least one segment"
        self.k = k
        self.part_rows = tuple(rows for rows, _ in parts)
        self.qtypes = tuple(qtype for _, qtype in parts)
        for index, (rows, qtype) in enumerate(parts):
            self.register_buffer(
                f"packed{index}",
                torch.empty((rows, row_bytes(qtype, k)), dtype=torch.uint8, device=device))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(self.part_rows), self.k))

    def segments(self) -> list[Segment]:
        found, start = [], 0
        for index, (rows, qtype) in enumerate(zip(self.part_rows, self.qtypes, strict=True)):
            found.append(Segment(start, rows, qtype, getattr(self, f"packed{index}")))
            start += rows
        return found

    @property
    def nbytes(self) -> int:
        return sum(s.packed.numel() for s in self.segments())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [N, K], as the dequantizing load would hold it."""
        parts = [dequantize(s.packed, s.qtype, self.k).to(dtype) for s in self.segments()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def describe(self) -> str:
        return "+".join(TYPE_NAMES[q] for q in self.qtypes)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, types={self.describe()}"


def packed_kernels_available() -> bool:
    """Whether the packed GGUF kernels (kernels/gguf_quant.py) can be imported."""
    try:
        import kernels.gguf_quant  # noqa: F401
    except ImportError:
        return False
    return True


def quantized_weights(model: nn.Module) -> list[QuantizedWeight | Fp8Weight]:
    """Every weight slot the model holds quantized: GGUF blocks or FP8."""
    return [m for m in model.modules() if isinstance(m, (QuantizedWeight, Fp8Weight))]


def largest_quantized_elements(model: nn.Module) -> int:
    """N * K of the model's largest packed or FP8 weight (0: none); sizes
    CudaOps' dequantization scratch."""
    return max((w.shape.numel() for w in quantized_weights(model)), default=0)
