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
    CUDA_CORE_GEMV_MAX_ROWS,
    CUDA_CORE_GEMV_ROWS,
    GGUF_KERNEL_TYPES,
    QUANT_GEMV_MAX_ROWS,
    cuda_core_gemv_fits,
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


# (N, K) of the Qwen3-0.6B, 1.7B, 4B and 8B projections (qkv, o, gate_up,
# down) and 0.6B's lm_head.
QWEN3_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                (4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144),
                (6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728),
                (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                (151936, 1024)]


@pytest.mark.parametrize("qtype", sorted(GGUF_KERNEL_TYPES))
def test_cuda_core_gemv_takes_decode_batches_of_the_qwen3_shapes(qtype: int) -> None:
    # Batch 1 and 2 everywhere; 3 and 4 rows where the staged x (M * K
    # float32) fits: not at the 4B/8B down projections' K with 4 rows.
    assert CUDA_CORE_GEMV_MAX_ROWS == 4
    for n, k in QWEN3_SHAPES:
        for rows in (1, 2, 3, 4):
            fits = cuda_core_gemv_fits(rows, n, k, qtype, sms=132)
            if rows <= 2 or k <= 6144:
                assert fits, (n, k, rows)
            if rows == 4 and k >= 9728:
                assert not fits, (n, k, rows)
        assert not cuda_core_gemv_fits(5, n, k, qtype, sms=132)
        assert not cuda_core_gemv_fits(1, n, k, qtype, sms=132, shared_limit=4 * k)
    with pytest.raises(ValueError, match="has no GPU kernel"):
        cuda_core_gemv_fits(1, 64, 256, 3, sms=132)


def test_quant_gemv_picks_the_cuda_cores_only_where_they_measured_faster() -> None:
    # Every kernel type has an entry, within what the kernel takes.
    assert set(CUDA_CORE_GEMV_ROWS) == set(GGUF_KERNEL_TYPES)
    assert all(0 <= rows <= CUDA_CORE_GEMV_MAX_ROWS for rows in CUDA_CORE_GEMV_ROWS.values())
    assert CUDA_CORE_GEMV_ROWS[8] == 0 and CUDA_CORE_GEMV_ROWS[12] == 1


@pytest.mark.parametrize(("n", "k"), [*QWEN3_SHAPES, (5, 32), (33, 1056), (1000, 1056),
                                      (40000, 256)])
@pytest.mark.parametrize("sms", [132, 78])
def test_cuda_core_gemv_layout(n: int, k: int, sms: int) -> None:
    ctas, warps, slots = gguf_quant._small_layout(n, k, sms)
    units, tiles = -(-k // 256), -(-n // 8)
    assert 1 <= ctas <= min(sms, tiles)
    # A warp never lacks a unit; at most 32 warps (1024 threads) a CTA, and
    # 15 slots where they meet at named barriers 1..15.
    assert 1 <= warps <= units
    assert warps * slots <= 32
    assert slots <= 15 or warps == 1
    # No layout does fewer unit-steps per warp.
    def steps(w: int) -> int:
        s = 32 if w == 1 else min(32 // w, 15)
        return -(-tiles // (ctas * s)) * -(-units // w)
    assert steps(warps) == min(steps(w) for w in range(1, min(units, 32) + 1))


def test_cuda_core_gemv_layout_keeps_row_slices_in_the_same_order() -> None:
    # The engine runs a weight in row slices into columns of one output; for
    # K of at most 8 units each slice splits K between the same warps as the
    # whole weight (the GPU test checks the bits).
    for k in (256, 1024, 1056, 2048):
        whole = gguf_quant._small_layout(1000, k, 132)[1]
        assert whole == -(-k // 256)
        assert all(gguf_quant._small_layout(rows, k, 132)[1] == whole for rows in (1, 37, 463))


def test_cuda_core_gemv_shared_bytes() -> None:
    # x as float32 padded 4 per 64, sums per group (Q6_K: 16, else 32; none
    # for Q8_0), scratch 2 x slots x W x 8 rows x M.
    assert gguf_quant._small_shared_bytes(1, 4096, 8, 8, 4) == 4 * (4096 + 256 + 2 * 4 * 8 * 8)
    assert gguf_quant._small_shared_bytes(2, 4096, 12, 8, 4) == 4 * (
        2 * 4352 + 2 * 128 + 2 * 4 * 8 * 8 * 2)
    assert gguf_quant._small_shared_bytes(1, 1056, 2, 5, 6) == 4 * (1056 + 68 + 36 + 2 * 6 * 5 * 8)
    assert gguf_quant._small_shared_bytes(3, 1024, 14, 4, 8) == 4 * (
        3 * 1088 + 3 * 64 + 2 * 8 * 4 * 8 * 3)
