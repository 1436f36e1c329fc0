"""kernels/fp8_reference.py: the block layout of FP8 weights, exact
dequantization, and the block quantization --quantize fp8 uses."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_reference import (
    E4M3_MAX,
    FP8,
    block_scales_of_tensor,
    dequantize,
    quantize_blocks,
    scale_shape,
)


def test_scale_shape_counts_partial_blocks() -> None:
    assert scale_shape(4096, 12288) == (32, 96)
    assert scale_shape(130, 100) == (2, 1)


def test_dequantize_is_value_times_its_block_scale() -> None:
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(200, 300, generator=generator) * 50).to(FP8)
    scales = torch.rand(2, 3, generator=generator) + 0.5
    got = dequantize(values, scales)
    for row, column in [(0, 0), (127, 127), (128, 0), (199, 299), (5, 256)]:
        expected = values[row, column].float() * scales[row // 128, column // 128]
        assert got[row, column].item() == expected.item()
    with pytest.raises(ValueError, match="scales must be"):
        dequantize(values, scales[:1])


def test_a_per_tensor_scale_is_a_table_of_it() -> None:
    table = block_scales_of_tensor(torch.tensor(0.25), 300, 128)
    assert table.shape == (3, 1) and torch.all(table == 0.25)
    with pytest.raises(ValueError, match="one element"):
        block_scales_of_tensor(torch.ones(2), 300, 128)


def test_quantize_blocks_fills_each_blocks_range() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 384, generator=generator)
    weight[128:, 128:256] = 0  # an all-zero block
    values, scales = quantize_blocks(weight)
    assert values.dtype == FP8 and scales.shape == (2, 3)
    assert scales[1, 1].item() == 1.0
    assert values[128:, 128:256].float().abs().max().item() == 0
    block = weight[:128, :128]
    assert scales[0, 0].item() == pytest.approx(block.abs().max().item() / E4M3_MAX)
    assert values[:128, :128].float().abs().max().item() == E4M3_MAX
    # e4m3 keeps 3 mantissa bits: within 1/16 of each element's magnitude.
    error = (dequantize(values, scales) - weight).abs()
    assert torch.all(error <= weight.abs() / 16 + scales.max() * 2**-9)


def test_e4m3_values_are_exact_in_bfloat16() -> None:
    every = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = every[torch.isfinite(every)]
    assert torch.equal(finite.to(torch.bfloat16).float(), finite)
