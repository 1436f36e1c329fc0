"""A linear layer's weight kept in FP8: float8 e4m3 values with float32
scales per 128 x 128 block (issue 19; kernels/fp8_reference.py).

An Fp8Weight stands in a model's weight slot (qkv_weight, o_weight,
gate_up_weight, down_weight, ...) in place of a float Parameter [N, K], as a
QuantizedWeight does for GGUF blocks (engine/execution/quantized_weight.py).
Its rows come in segments, one per checkpoint tensor (a fused qkv holds q, k
and v, each with its own scale table, whose 128-row blocks start at the
segment's first row). Each segment is two buffers: values float8_e4m3fn
[rows, K] and scales float32 [ceil(rows/128), K/128], so the device holds
one byte an element, and the model's named_buffers() walk reaches them:
sleep, wake and the memory ledger handle them as any other tensor.

It is filled from an FP8 checkpoint's tensors or, with --quantize fp8, by
quantizing the float tensor at load (fill_segment quantizes what is not FP8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kernels.fp8_reference import FP8, dequantize, quantize_blocks, scale_shape


@dataclass(frozen=True)
class Fp8Rows:
    """A checkpoint tensor in FP8: values [rows, k] e4m3 and its block scales."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]


@dataclass(frozen=True)
class Fp8Segment:
    """Rows [start, start + rows) of the matrix with their scale table."""

    start: int
    rows: int
    values: torch.Tensor  # float8_e4m3fn [rows, k]
    scales: torch.Tensor  # float32 [ceil(rows / 128), k / 128]


class Fp8Weight(nn.Module):
    """A weight [N, K] in FP8, in segments of rows."""

    def __init__(self, part_rows: Sequence[int], k: int, device: torch.device | str) -> None:
        """part_rows: the rows of each segment, top to bottom; the buffers
        are allocated empty on device, for the loader to fill."""
        super().__init__()
        assert part_rows, "an FP8 weight has at least one segment"
        self.k = k
        self.part_rows = tuple(part_rows)
        for index, rows in enumerate(self.part_rows):
            self.register_buffer(f"values{index}",
                                 torch.empty((rows, k), dtype=FP8, device=device))
            self.register_buffer(f"scales{index}", torch.empty(
                scale_shape(rows, k), dtype=torch.float32, device=device))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(self.part_rows), self.k))

    def segments(self) -> list[Fp8Segment]:
        found, start = [], 0
        for index, rows in enumerate(self.part_rows):
            found.append(Fp8Segment(start, rows, getattr(self, f"values{index}"),
                                    getattr(self, f"scales{index}")))
            start += rows
        return found

    @property
    def nbytes(self) -> int:
        return sum(s.values.numel() + s.scales.numel() * 4 for s in self.segments())

    def fill_segment(self, index: int, rows: Fp8Rows | torch.Tensor) -> None:
        """Copy an FP8 tensor into segment index, or quantize a float one
        (on the weight's device) into it."""
        values = getattr(self, f"values{index}")
        if not isinstance(rows, Fp8Rows):
            rows = Fp8Rows(*quantize_blocks(rows.to(values.device)))
        values.copy_(rows.values)
        getattr(self, f"scales{index}").copy_(rows.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [N, K], as the dequantizing load would hold it."""
        parts = [dequantize(s.values, s.scales).to(dtype) for s in self.segments()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def describe(self) -> str:
        return "fp8 e4m3, 128x128 block scales"

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, segments={len(self.part_rows)}"


def fp8_kernels_available() -> bool:
    """Whether the FP8 kernels (kernels/fp8_linear.py) can be imported."""
    try:
        import kernels.fp8_linear  # noqa: F401
    except ImportError:
        return False
    return True
