"""An fp8 KV cache's pieces that need no GPU: the kernels' scale arguments
and the torch reference's quantize / dequantize (kernels/reference.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache_dtype import reader_scales, writer_scales
from kernels.reference import paged_attention, quantize_fp8, write_kv_cache


def test_scale_arguments_are_for_fp8_kernels_only_and_checked() -> None:
    assert writer_scales(False, 1.0, 1.0) == reader_scales(False, 1.0, 1.0) == ()
    assert writer_scales(True, 0.5, 4.0) == (0.5, 4.0)
    # The readers undo the 2^-8 of moving e4m3 bits into an fp16's.
    assert reader_scales(True, 1.0, 0.5) == (2.0**8, 2.0**7)
    for bad in (0.0, -1.0, float("inf"), float("nan"), 128.0):
        with pytest.raises(ValueError, match="must be a positive, finite number below 128"):
            reader_scales(True, bad, 1.0)
    with pytest.raises(ValueError, match="v_scale must be a Python number"):
        writer_scales(True, 1.0, torch.tensor(1.0))  # type: ignore[arg-type]


def test_quantize_saturates_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([1000.0, -500.0, 448.0, 1.0625, 1.1875, 2.0**-10, 0.0])
    codes = quantize_fp8(x, 1.0).float().tolist()
    # 1.0625 is the tie between 1.0 and 1.125: the even 1.0; 1.1875 -> 1.25;
    # 2^-10 is half the smallest subnormal (2^-9): the even 0.
    assert codes == [448.0, -448.0, 448.0, 1.0, 1.25, 0.0, 0.0]
    assert quantize_fp8(torch.tensor([3.0]), 2.0).float().item() == 1.5


def test_reference_attention_reads_an_fp8_cache_as_its_scaled_values() -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (3, 8, 2, 16)  # pages, page size, kv heads, head size
    k, v = (torch.randn(shape, generator=generator) for _ in "kv")
    k8, v8 = (torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in "kv")
    slots = torch.arange(20)
    rows = k.view(-1, 2, 16)[:20], v.view(-1, 2, 16)[:20]
    write_kv_cache(*rows, k8, v8, slots, 0.5, 2.0)
    assert torch.equal(k8.view(-1, 2, 16)[:20].view(torch.uint8),
                       quantize_fp8(rows[0], 0.5).view(torch.uint8))
    q = torch.randn(4, 4, 16, generator=generator)
    tables = torch.arange(3, dtype=torch.int32)[None]
    out = paged_attention(q, k8, v8, [0, 4], [20], tables, 0.25, 0.5, 2.0)
    expected = paged_attention(q, k8.float() * 0.5, v8.float() * 2.0, [0, 4], [20], tables, 0.25)
    assert torch.equal(out, expected)
