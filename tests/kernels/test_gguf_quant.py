"""kernels.gguf_quant without a GPU: the block geometry it shares with gguf
and the loader, its launch layout, and the clear errors it raises before
touching a device."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kernels import gguf_quant
from kernels.gguf_quant import (
    GGUF_KERNEL_TYPES,
    QUANT_GEMV_MAX_ROWS,
    dequantize_to,
    packed_row_bytes,
    quant_gemv,
    quant_linear,
)


def test_kernel_types_are_gguf_ids_and_names() -> None:
    assert GGUF_KERNEL_TYPES == {2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
    for qtype, name in GGUF_KERNEL_TYPES.items():
        assert T(qtype).name == name


@pytest.mark.parametrize("qtype", sorted(GGUF_KERNEL_TYPES))
@pytest.mark.parametrize("k", [256, 1024, 3072, 4096, 12288])
def test_row_bytes_match_gguf(qtype: int, k: int) -> None:
    assert packed_row_bytes(qtype, k) == gguf.quant_shape_to_byte_shape((1, k), T(qtype))[1]


def test_row_bytes_of_small_blocks_and_bad_k() -> None:
    assert packed_row_bytes(8, 576) == 18 * 34  # SmolLM2's hidden size in Q8_0
    assert packed_row_bytes(2, 32) == 18
    for qtype, k in [(8, 48), (2, 0), (12, 576), (13, 1000), (14, -256)]:
        with pytest.raises(ValueError, match="K must be a positive multiple of"):
            packed_row_bytes(qtype, k)


@pytest.mark.parametrize("qtype", [0, 1, 3, 6, 10, 11, 23])
def test_types_without_a_kernel_are_refused_by_name(qtype: int) -> None:
    with pytest.raises(ValueError, match=r"has no GPU kernel; supported: 2 \(Q4_0\)"):
        packed_row_bytes(qtype, 256)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    packed = torch.zeros(1, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="has no GPU kernel"):
        quant_gemv(x, packed, qtype)
    with pytest.raises(ValueError, match="has no GPU kernel"):
        quant_linear(x, packed, qtype, 256)


def test_cpu_tensors_are_refused() -> None:
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    packed = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        quant_gemv(x, packed, 12)
    with pytest.raises(ValueError, match="out must be a CUDA tensor"):
        dequantize_to(packed, 12, torch.zeros(4, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        quant_linear(torch.zeros(64, 256, dtype=torch.bfloat16), packed, 12, 256)


def test_gemv_row_limit_is_two_mma_tiles() -> None:
    # The kernel has one instance per 8 x rows (n8 tiles): 1 and 2.
    assert QUANT_GEMV_MAX_ROWS == 16


def test_the_most_warps_fit_in_shared_memory() -> None:
    # Hopper gives a CTA at most 227 KiB of shared memory.
    for qtype in GGUF_KERNEL_TYPES:
        assert gguf_quant._WARPS_FEW_CTAS * gguf_quant._WARP_SHARED[qtype] <= 227 * 1024


@pytest.mark.parametrize(("n", "k", "qtype"), [(4096, 4096, 12), (24576, 4096, 8),
                                                (1024, 2048, 14), (960, 576, 8), (16, 256, 13)])
def test_gemv_layout(n: int, k: int, qtype: int) -> None:
    sms = 132
    ctas, warps, blocks, units = gguf_quant._gemv_layout(n, k, qtype, sms)
    assert ctas * 16 >= n > (ctas - 1) * 16
    assert blocks * (32 if qtype in (2, 8) else 256) == k
    assert units == -(-k // 256)
    # Never a warp without work; more warps when the grid leaves SMs idle.
    assert 1 <= warps <= units
    assert warps <= (8 if ctas >= sms else 16)
