"""kernels.skinny_gemm.skinny_linear against F.linear computed in float64 from the
same bf16 inputs, for every row count 1..8 and the decode projection shapes.

The kernel accumulates bf16 products in float32 and rounds once to bf16, so
each output row is within bf16 rounding (~2e-3 relative) of the exact result;
the bound checked is 1e-2 per row, so a wrong row, a missing K piece or a
swapped column shows up at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16

# (N, K) of weight [N, K].
QWEN3_0_6B = [(6144, 1024), (4096, 1024), (1024, 3072), (1024, 2048)]
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
SMOLLM2 = [(960, 576), (576, 1536), (3072, 576), (2560, 960)]
# Odd N (partial row groups and CTAs, odd output row length), K not a multiple
# of the 128-wide warp step, tiny and boundary cases of the layout choice;
# (4352, 64): two row groups in a CTA of one warp (one step of K), whose
# second group's outputs were once left unwritten.
ODD = [(1000, 1024), (9, 576), (1, 8), (33, 24), (2056, 1000), (4097, 264), (2113, 136),
       (4352, 64)]
SHAPES = QWEN3_0_6B + QWEN3_8B + SMOLLM2 + ODD


def random_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 weight [N, K] (Linear-init scale) and bf16 bias [N], never zero."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(n, k, device="cuda", generator=generator) / k**0.5).to(BF16)
    bias = (0.5 * torch.randn(n, device="cuda", generator=generator)).to(BF16)
    return weight, bias


def random_x(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 [M, K] with rows of different scales, so a swapped row shows."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=generator)
    scale = torch.linspace(0.5, 4.0, rows, device="cuda").unsqueeze(1)
    return (x * scale).to(BF16)


def exact_linear(x: torch.Tensor, weight64: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight64, None if bias is None else bias.double())


def assert_rows_close(out: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    assert not out.isnan().any(), f"{what}: unwritten (NaN-poisoned) or NaN elements"
    error = (out.double() - exact).norm(dim=1) / exact.norm(dim=1)
    worst = float(error.max())
    assert worst < 1e-2, f"{what}: relative error {worst:.2e} (per row {error.tolist()})"


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_float64_linear_for_every_row_count(n: int, k: int) -> None:
    from kernels.skinny_gemm import SKINNY_MAX_ROWS, skinny_linear, skinny_linear_supported

    weight, bias = random_weight(n, k, seed=n * 31 + k)
    weight_before = weight.clone()
    weight64 = weight.double()
    for rows in range(1, SKINNY_MAX_ROWS + 1):
        x = random_x(rows, k, seed=rows * 1009 + n + k)
        x_before = x.clone()
        assert skinny_linear_supported(x, weight)
        for with_bias in (False, True):
            b = bias if with_bias else None
            out = torch.full((rows, n), float("nan"), device="cuda", dtype=BF16)
            result = skinny_linear(x, weight, b, out=out)
            torch.cuda.synchronize()
            assert result is out
            assert_rows_close(out, exact_linear(x, weight64, b), f"M={rows} bias={with_bias}")
        # Allocated output, and the same bits on a second run (fixed reduction
        # order; a race would move them).
        first = skinny_linear(x, weight, bias)
        second = skinny_linear(x, weight, bias)
        torch.cuda.synchronize()
        assert first.shape == (rows, n) and first.dtype == BF16 and first.is_contiguous()
        assert torch.equal(first, second)
        assert torch.equal(x, x_before)
    assert torch.equal(weight, weight_before)


def test_close_to_cublas() -> None:
    """Close to F.linear in bf16 (cuBLAS): both round float32-class sums to
    bf16 (cuBLAS may also reduce split-K partials in bf16, hence the margin)."""
    from kernels.skinny_gemm import skinny_linear

    weight, bias = random_weight(4096, 1024, seed=7)
    x = random_x(5, 1024, seed=8)
    ours = skinny_linear(x, weight, bias).double()
    cublas = F.linear(x, weight, bias).double()
    error = (ours - cublas).norm() / cublas.norm()
    assert error < 1e-2, f"relative difference from cuBLAS {error:.2e}"


@pytest.mark.parametrize(("n", "k", "rows"), [(6144, 1024, 1), (1024, 3072, 4), (960, 576, 8)])
def test_cuda_graph_replay_with_new_x(n: int, k: int, rows: int) -> None:
    """Captured with a preallocated out, replayed after x changes in place."""
    from kernels.skinny_gemm import skinny_linear

    weight, bias = random_weight(n, k, seed=11)
    weight64 = weight.double()
    x = random_x(rows, k, seed=12)
    out = torch.empty(rows, n, device="cuda", dtype=BF16)
    skinny_linear(x, weight, bias, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, weight, bias, out=out)
    for seed in (13, 14):
        new_x = random_x(rows, k, seed=seed)
        x.copy_(new_x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rows_close(out, exact_linear(new_x, weight64, bias), f"replay seed {seed}")


def test_supported_checks() -> None:
    from kernels.skinny_gemm import skinny_linear_supported

    weight = torch.randn(64, 128, device="cuda", dtype=BF16)
    x = torch.randn(3, 128, device="cuda", dtype=BF16)
    assert skinny_linear_supported(x, weight)
    assert skinny_linear_supported(x[:1], weight)
    assert skinny_linear_supported(torch.randn(8, 128, device="cuda", dtype=BF16), weight)
    unsupported = [
        (torch.randn(9, 128, device="cuda", dtype=BF16), weight),  # M = 9
        (torch.empty(0, 128, device="cuda", dtype=BF16), weight),  # M = 0
        (torch.randn(3, 124, device="cuda", dtype=BF16),
         torch.randn(64, 124, device="cuda", dtype=BF16)),  # K % 8 != 0
        (x.float(), weight),
        (x, weight.float()),
        (x.half(), weight.half()),
        (torch.randn(3, 256, device="cuda", dtype=BF16)[:, ::2], weight),  # non-contiguous x
        (x, torch.randn(128, 64, device="cuda", dtype=BF16).t()),  # non-contiguous weight
        (x, weight[:, :64]),  # K mismatch (and non-contiguous)
        (x, torch.randn(64, 64, device="cuda", dtype=BF16)),  # K mismatch
        (x[0], weight),  # 1-D x
        (x.unsqueeze(0), weight),  # 3-D x
        (x.cpu(), weight.cpu()),
        (x, weight.cpu()),
        # Contiguous but 2 bytes off a 16-byte boundary.
        (torch.randn(3 * 128 + 1, device="cuda", dtype=BF16)[1:].view(3, 128), weight),
        (x, torch.randn(64 * 128 + 1, device="cuda", dtype=BF16)[1:].view(64, 128)),
    ]
    for bad_x, bad_weight in unsupported:
        assert not skinny_linear_supported(bad_x, bad_weight), (bad_x.shape, bad_x.dtype)


def test_bad_inputs_raise() -> None:
    from kernels.skinny_gemm import skinny_linear

    weight = torch.randn(64, 128, device="cuda", dtype=BF16)
    bias = torch.randn(64, device="cuda", dtype=BF16)
    x = torch.randn(3, 128, device="cuda", dtype=BF16)
    square_weight = torch.randn(128, 128, device="cuda", dtype=BF16)
    bad_calls = [
        lambda: skinny_linear(x.float(), weight),
        lambda: skinny_linear(x, weight.float()),
        lambda: skinny_linear(torch.randn(9, 128, device="cuda", dtype=BF16), weight),
        lambda: skinny_linear(torch.empty(0, 128, device="cuda", dtype=BF16), weight),
        lambda: skinny_linear(x[0], weight),
        lambda: skinny_linear(x.unsqueeze(0), weight),
        lambda: skinny_linear(x, torch.randn(64, 64, device="cuda", dtype=BF16)),
        lambda: skinny_linear(torch.randn(3, 124, device="cuda", dtype=BF16),
                              torch.randn(64, 124, device="cuda", dtype=BF16)),
        lambda: skinny_linear(torch.randn(3, 256, device="cuda", dtype=BF16)[:, ::2], weight),
        lambda: skinny_linear(x, torch.randn(128, 64, device="cuda", dtype=BF16).t()),
        lambda: skinny_linear(x.cpu(), weight.cpu()),
        lambda: skinny_linear(x, weight.cpu()),
        lambda: skinny_linear(torch.randn(3 * 128 + 1, device="cuda", dtype=BF16)[1:].view(3, 128),
                              weight),
        lambda: skinny_linear(x, torch.randn(64 * 128 + 1, device="cuda",
                                             dtype=BF16)[1:].view(64, 128)),
        lambda: skinny_linear(x, weight, bias[:32]),
        lambda: skinny_linear(x, weight, bias.float()),
        lambda: skinny_linear(x, weight, bias.view(1, 64)),
        lambda: skinny_linear(x, weight, bias.cpu()),
        lambda: skinny_linear(x, weight, out=torch.empty(3, 32, device="cuda", dtype=BF16)),
        lambda: skinny_linear(x, weight, out=torch.empty(3, 64, device="cuda")),
        lambda: skinny_linear(x, weight, out=torch.empty(64, 3, device="cuda", dtype=BF16).t()),
        # out overlapping an input: other CTAs may still read it.
        lambda: skinny_linear(x, square_weight, out=x),
        lambda: skinny_linear(x, square_weight, out=square_weight[:3]),
    ]
    # out sharing memory with the bias.
    shared = torch.randn(4 * 64, device="cuda", dtype=BF16)
    bad_calls.append(lambda: skinny_linear(x, weight, shared[:64], out=shared[:192].view(3, 64)))
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
