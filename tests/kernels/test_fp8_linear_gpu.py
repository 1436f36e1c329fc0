"""kernels.fp8_linear on the GPU against kernels/fp8_reference.py.

dequantize_to must be bit-equal to the reference's float32 value * scale
rounded to bf16. The GEMV feeds the e4m3 values to the tensor cores exactly
(as bf16) and applies each 128-column block's scale in float32, so each
output is the float32 product of the dequantized weight up to the rounding
of value * scale and float32 accumulation order, rounded once to bf16:
within 2^-8 * |exact| plus a float32-sized share of sum(|x| |w|). A
misplaced element, block or scale is far outside that.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8_reference import dequantize, quantize_blocks
from tests.kernels.graph_replay import assert_replay_equals_eager

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
# (N, K) of weight [N, K]: Qwen3-8B's and -0.6B's projections, and N not a
# multiple of the 16-row CTA or of the 128-row scale block.
SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (2048, 1024), (1000, 1024), (37, 384)]
ROWS = tuple(range(1, 17))


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dense = torch.randn(n, k, device="cuda", generator=generator)
    # Blocks of different magnitudes, so a wrong scale shows.
    dense *= torch.rand(-(-n // 128), -(-k // 128), device="cuda", generator=generator
                        ).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k] * 4 + 0.1
    return quantize_blocks(dense)


def random_x(rows: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, k, device="cuda", generator=generator).to(BF16)


def assert_close_to_exact(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    exact = F.linear(x.double(), dense.double())
    magnitude = F.linear(x.double().abs(), dense.double().abs())
    bound = exact.abs() * 2**-8 + magnitude * 1e-5
    excess = (got.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"worst excess {excess.max().item()}"


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_dequantize_to_is_bit_exact(n: int, k: int) -> None:
    from kernels.fp8_linear import dequantize_to

    values, scales = fp8_weight(n, k, seed=n + k)
    out = torch.empty(n, k, device="cuda", dtype=BF16)
    dequantize_to(values, scales, out)
    assert torch.equal(out, dequantize(values, scales).to(BF16))


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemv_matches_the_dequantized_product(n: int, k: int) -> None:
    from kernels.fp8_linear import fp8_gemv

    values, scales = fp8_weight(n, k, seed=3 * n + k)
    dense = dequantize(values, scales)
    for rows in ROWS:
        x = random_x(rows, k, seed=rows)
        assert_close_to_exact(fp8_gemv(x, values, scales), x, dense)


def test_gemv_writes_a_column_range_of_a_wider_output() -> None:
    from kernels.fp8_linear import fp8_gemv

    values, scales = fp8_weight(256, 1024, seed=7)
    x = random_x(5, 1024, seed=8)
    wide = torch.full((5, 768), 7.0, device="cuda", dtype=BF16)
    fp8_gemv(x, values, scales, out=wide[:, 256:512])
    assert torch.equal(wide[:, 256:512], fp8_gemv(x, values, scales))
    assert torch.all(wide[:, :256] == 7) and torch.all(wide[:, 512:] == 7)


def test_linear_takes_the_gemv_or_dequantize_and_cublas() -> None:
    from kernels.fp8_linear import FP8_GEMV_MAX_ROWS, fp8_gemv, fp8_linear

    values, scales = fp8_weight(1024, 2048, seed=9)
    for rows in (1, FP8_GEMV_MAX_ROWS):
        x = random_x(rows, 2048, seed=rows)
        assert torch.equal(fp8_linear(x, values, scales), fp8_gemv(x, values, scales))
    x = random_x(100, 2048, seed=10)
    dense = dequantize(values, scales).to(BF16)
    assert torch.equal(fp8_linear(x, values, scales), F.linear(x, dense))


def test_cuda_graph_replay_equals_eager() -> None:
    """GEMV (M = 1 and 16) and the dequantize + cuBLAS path (M = 64) captured
    with preallocated outputs, replayed after x changes in place: the same
    bits as eager calls, and nothing allocated by the out= calls."""
    from kernels.fp8_linear import fp8_linear

    n, k = 4096, 1024
    values, scales = fp8_weight(n, k, seed=21)
    scratch = torch.empty(n * k, device="cuda", dtype=BF16)
    xs = {rows: random_x(rows, k, seed=rows) for rows in (1, 16, 64)}
    outs = {rows: torch.empty(rows, n, device="cuda", dtype=BF16) for rows in xs}

    def step() -> None:
        for rows, x in xs.items():
            fp8_linear(x, values, scales, out=outs[rows], scratch=scratch)

    assert_replay_equals_eager(step, xs, outs,
                               lambda x: fp8_linear(x, values, scales, scratch=scratch),
                               lambda rows, seed: random_x(rows, k, seed=seed), seeds=(31, 32))


def test_argument_errors() -> None:
    from kernels.fp8_linear import dequantize_to, fp8_gemv

    values, scales = fp8_weight(64, 256, seed=1)
    x = random_x(2, 256, seed=2)
    bad = {
        "x must be torch.bfloat16": lambda: fp8_gemv(x.float(), values, scales),
        "x must have 1 to 16 rows": lambda: fp8_gemv(random_x(17, 256, 3), values, scales),
        "scales must be": lambda: fp8_gemv(x, values, scales[:, :1].contiguous()),
        "K a positive multiple of 128": lambda: fp8_gemv(
            random_x(2, 64, 4), values[:, :64].contiguous(), scales[:, :1].contiguous()),
        "x must be \\[M, 256\\]": lambda: fp8_gemv(random_x(2, 384, 5), values, scales),
        "out must be \\(64, 256\\)": lambda: dequantize_to(
            values, scales, torch.empty(64, 128, device="cuda", dtype=BF16)),
    }
    for message, call in bad.items():
        with pytest.raises(ValueError, match=message):
            call()
