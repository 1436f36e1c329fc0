"""kernels.skinny_fused's host-side rules, without a GPU: which shapes the
norm prologue takes, and that the SwiGLU kernel splits K as skinny_linear
does at the decode shapes (the condition for its exact bits)."""

from __future__ import annotations

import pytest

from kernels.skinny_fused import NORM_MAX_K, NORM_MAX_SHARED_BYTES, norm_fits, swiglu_layout
from kernels.skinny_gemm import _layout

H200_SMS = 132


@pytest.mark.parametrize(("rows", "k"), [(1, 8), (8, 1024), (8, 4096), (8, 8192), (8, 12288),
                                         (4, 16384), (1, NORM_MAX_K)])
def test_the_norm_prologue_takes_model_widths(rows: int, k: int) -> None:
    assert norm_fits(rows, k)


def test_the_norm_prologue_refuses_what_shared_memory_cannot_hold() -> None:
    # 8 rows of 16,384: 262 KB of normalized rows, past Hopper's 227 KiB.
    assert 8 * (16384 // 8 + 1) * 16 > NORM_MAX_SHARED_BYTES
    assert not norm_fits(8, 16384)
    assert not norm_fits(1, NORM_MAX_K + 8)


# (I, K) of Qwen3-0.6B, -1.7B, -4B, -8B and SmolLM2-135M's MLPs.
@pytest.mark.parametrize(("intermediate", "k"), [(3072, 1024), (6144, 2048), (9728, 2560),
                                                 (12288, 4096), (1536, 576)])
def test_the_swiglu_kernel_splits_k_as_the_unfused_gemm(intermediate: int, k: int) -> None:
    ctas, warps, steps = swiglu_layout(intermediate, k)
    _, _, plain_warps, plain_steps = _layout(2 * intermediate, k, H200_SMS)
    assert (warps, steps) == (plain_warps, plain_steps)
    assert ctas * 8 >= intermediate
