"""kernels.gguf_quant on the GPU against gguf's own dequantization.

Reference: gguf.quants.dequantize (float32, exact), then a float64 matmul
with the same bf16 x. The GEMV feeds the block integers to the tensor cores
exactly and applies the scales in float32, so each output element is the
exact value up to float32 accumulation, rounded once to bf16: within
2^-8 * |exact| plus a float32-sized share of sum(|x| |w|). A misplaced
element, block or scale is far outside that. dequantize_to must be
bit-equal to gguf's float32 values rounded to bf16.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.kernels.gguf_blocks import dequantized, random_packed
from tests.kernels.graph_replay import assert_replay_equals_eager

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
TYPES = {2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# (N, K) of weight [N, K]: Qwen3-0.6B and -8B projections.
SHAPES = [(2048, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4096, 4096), (24576, 4096),
          (4096, 12288)]
# N not a multiple of the 16-row CTA; rows whose byte length is not a
# multiple of 16 (Q6_K at K = 1024 or 3072, Q8_0 and Q4_0 at K % 256 != 0);
# K of SmolLM2 (576, 960, 1536).
ODD_SHAPES = [(1000, 1024), (37, 3072), (960, 576), (1536, 960), (33, 1056), (5, 32)]
ROWS = (1, 2, 3, 8, 9, 16)


def shapes_for(qtype: int, shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    block = 32 if qtype in (2, 8) else 256
    return [(n, k) for n, k in shapes if k % block == 0]


def cases(shapes: list[tuple[int, int]]) -> list:
    return [pytest.param(q, n, k, id=f"{TYPES[q]}-{n}x{k}")
            for q in TYPES for n, k in shapes_for(q, shapes)]


CASES = cases(SHAPES + ODD_SHAPES)
# dequantize_to is elementwise: the largest matrices add only time.
DEQUANT_CASES = cases([(2048, 1024), (1024, 3072), (4096, 4096), *ODD_SHAPES])


def packed_weight(qtype: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """(packed uint8 [N, row_bytes] on the GPU, gguf's float32 weight [N, K])."""
    packed = random_packed(np.random.default_rng(seed), qtype, n, k)
    return torch.from_numpy(packed).cuda(), dequantized(packed, qtype)


def random_x(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 [M, K] with rows of different scales (a swapped row shows) and a
    non-zero mean (so the K-quants' minimum term matters)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=generator) + 0.25
    scale = torch.linspace(0.5, 4.0, rows, device="cuda").unsqueeze(1)
    return (x * scale).to(BF16)


def assert_close_to_exact(out: torch.Tensor, x: torch.Tensor, weight64: torch.Tensor,
                          what: str) -> None:
    assert not out.isnan().any(), f"{what}: unwritten (NaN-poisoned) or NaN elements"
    exact = x.double() @ weight64.T
    magnitude = x.double().abs() @ weight64.abs().T
    error = (out.double() - exact).abs()
    bound = 2.0**-8 * exact.abs() + 1e-5 * magnitude
    worst = int((error - bound).argmax())
    m, n = divmod(worst, out.shape[1])
    assert bool((error <= bound).all()), (
        f"{what}: out[{m}, {n}] = {float(out[m, n]):.6g}, exact {float(exact[m, n]):.6g} "
        f"(bound {float(bound[m, n]):.3g}); {int((error > bound).sum())} of {error.numel()} "
        f"elements outside")


@pytest.mark.parametrize(("qtype", "n", "k"), CASES)
def test_gemv_matches_gguf_dequantize_then_matmul(qtype: int, n: int, k: int) -> None:
    from kernels.gguf_quant import QUANT_GEMV_MAX_ROWS, quant_gemv

    packed, weight = packed_weight(qtype, n, k, seed=n * 7 + k + qtype)
    packed_before = packed.clone()
    weight64 = torch.from_numpy(weight).cuda().double()
    for rows in ROWS:
        assert rows <= QUANT_GEMV_MAX_ROWS
        x = random_x(rows, k, seed=rows * 1009 + n + k)
        x_before = x.clone()
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=BF16)
        result = quant_gemv(x, packed, qtype, out=out)
        torch.cuda.synchronize()
        assert result is out
        assert_close_to_exact(out, x, weight64, f"{TYPES[qtype]} {n}x{k} M={rows}")
        # A second run gives the same bits (fixed reduction order).
        again = quant_gemv(x, packed, qtype)
        assert again.shape == (rows, n) and again.dtype == BF16
        assert torch.equal(again, out), "not deterministic"
        assert torch.equal(x, x_before)
    assert torch.equal(packed, packed_before)


@pytest.mark.parametrize(("qtype", "n", "k"), DEQUANT_CASES)
def test_dequantize_to_is_bit_exact(qtype: int, n: int, k: int) -> None:
    from kernels.gguf_quant import dequantize_to

    packed, weight = packed_weight(qtype, n, k, seed=n + 3 * k + qtype)
    expected = torch.from_numpy(weight).to(BF16)  # float32 -> bf16, round to nearest even
    out = torch.full((n, k), float("nan"), device="cuda", dtype=BF16)
    assert dequantize_to(packed, qtype, out) is out
    got = out.cpu()
    differ = (got.view(torch.int16) != expected.view(torch.int16)).nonzero()
    if len(differ):
        row, col = (int(v) for v in differ[0])
        pytest.fail(f"{TYPES[qtype]} {n}x{k}: {len(differ)} elements differ; first [{row}, {col}]"
                    f" = {float(got[row, col])!r}, gguf {float(weight[row, col])!r}")


@pytest.mark.parametrize("qtype", list(TYPES), ids=list(TYPES.values()))
def test_dequantize_to_handles_large_and_negative_scales(qtype: int) -> None:
    """Scales of every size and sign (where the format has a sign), so the
    exactness does not hinge on small numbers."""
    import gguf

    from kernels.gguf_quant import dequantize_to

    rng = np.random.default_rng(qtype)
    n, k = 64, 1024
    packed = random_packed(rng, qtype, n, k)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    blocks = packed.reshape(n, -1, size)
    offset = 208 if qtype == 14 else 0
    wide = (rng.standard_normal((n, k // block)) * 100).astype(np.float16)
    blocks[:, ::2, offset:offset + 2] = wide[:, ::2, None].view(np.uint8).reshape(n, -1, 2)
    weight = dequantized(packed, qtype)
    assert np.isfinite(weight).all()
    out = torch.empty((n, k), device="cuda", dtype=BF16)
    dequantize_to(torch.from_numpy(packed).cuda(), qtype, out)
    assert torch.equal(out.cpu().view(torch.int16),
                       torch.from_numpy(weight).to(BF16).view(torch.int16))


@pytest.mark.parametrize("qtype", list(TYPES), ids=list(TYPES.values()))
@pytest.mark.parametrize("rows", [17, 64, 256])
def test_quant_linear_for_large_batches(qtype: int, rows: int) -> None:
    """Past QUANT_GEMV_MAX_ROWS: dequantize into scratch, then cuBLAS; within
    bf16 GEMM rounding of the exact result, and the same with or without a
    caller's (larger) scratch."""
    import torch.nn.functional as F

    from kernels.gguf_quant import quant_linear

    n, k = 2048, 1024
    packed, weight = packed_weight(qtype, n, k, seed=rows + qtype)
    weight64 = torch.from_numpy(weight).cuda().double()
    x = random_x(rows, k, seed=rows)
    out = quant_linear(x, packed, qtype, k)
    exact = x.double() @ weight64.T
    error = (out.double() - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(error.max()) < 1e-2, f"relative error per row {error.tolist()}"
    scratch = torch.empty(n * k + 4096, device="cuda", dtype=BF16)
    assert torch.equal(quant_linear(x, packed, qtype, k, scratch=scratch), out)
    # Exactly F.linear with the dequantized bf16 weight.
    assert torch.equal(out, F.linear(x, torch.from_numpy(weight).cuda().to(BF16)))
    given = torch.empty(rows, n, device="cuda", dtype=BF16)
    assert quant_linear(x, packed, qtype, k, out=given, scratch=scratch) is given
    assert torch.equal(given, out)


@pytest.mark.parametrize("qtype", list(TYPES), ids=list(TYPES.values()))
@pytest.mark.parametrize("rows", [3, 12, 40])
def test_row_slices_write_their_columns_of_one_output(qtype: int, rows: int) -> None:
    """As the engine runs a weight in row chunks: packed[first:last] (not
    16-byte aligned for Q8_0, Q4_0 and Q6_K rows of these K) into
    out[:, first:last], a column range with row stride N. The same bits as
    one call over the whole weight (GEMV) and close to the exact result."""
    from kernels.gguf_quant import quant_linear

    n, k = 1000, 1024 if qtype not in (2, 8) else 1056
    packed, weight = packed_weight(qtype, n, k, seed=rows * 3 + qtype)
    x = random_x(rows, k, seed=rows)
    whole = quant_linear(x, packed, qtype, k)
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=BF16)
    bounds = [0, 1, 37, 38, 501, 998, n]
    for first, last in itertools.pairwise(bounds):
        quant_linear(x, packed[first:last], qtype, k, out=out[:, first:last])
    torch.cuda.synchronize()
    weight64 = torch.from_numpy(weight).cuda().double()
    if rows <= 16:
        # K has at most 5 units of 256, so every call splits K between the
        # same warps and sums in the same order: bit-equal.
        assert torch.equal(out, whole), "a row slice differs from the whole weight's call"
        assert_close_to_exact(out, x, weight64, f"{TYPES[qtype]} row slices M={rows}")
    else:
        # cuBLAS may pick another algorithm for a narrower matrix.
        exact = x.double() @ weight64.T
        error = (out.double() - exact).norm(dim=1) / exact.norm(dim=1)
        assert float(error.max()) < 1e-2, f"relative error per row {error.tolist()}"


@pytest.mark.parametrize("qtype", list(TYPES), ids=list(TYPES.values()))
def test_quant_linear_uses_the_gemv_for_few_rows(qtype: int) -> None:
    from kernels.gguf_quant import QUANT_GEMV_MAX_ROWS, quant_gemv, quant_linear

    n, k = 512, 1024
    packed, _ = packed_weight(qtype, n, k, seed=5)
    for rows in (1, QUANT_GEMV_MAX_ROWS):
        x = random_x(rows, k, seed=rows)
        assert torch.equal(quant_linear(x, packed, qtype, k), quant_gemv(x, packed, qtype))


@pytest.mark.parametrize("qtype", list(TYPES), ids=list(TYPES.values()))
def test_cuda_graph_replay_equals_eager(qtype: int) -> None:
    """GEMV (M = 1 and 16) and the dequantize + cuBLAS path (M = 64) captured
    with preallocated outputs, replayed after x changes in place: the same
    bits as eager calls, and nothing allocated by the replays or the out= calls."""
    from kernels.gguf_quant import quant_gemv, quant_linear

    n, k = 4096, 1024
    packed, _ = packed_weight(qtype, n, k, seed=21)
    scratch = torch.empty(n * k, device="cuda", dtype=BF16)
    xs = {rows: random_x(rows, k, seed=rows) for rows in (1, 16, 64)}
    outs = {rows: torch.empty(rows, n, device="cuda", dtype=BF16) for rows in xs}

    def step() -> None:
        quant_gemv(xs[1], packed, qtype, out=outs[1])
        quant_gemv(xs[16], packed, qtype, out=outs[16])
        quant_linear(xs[64], packed, qtype, k, out=outs[64], scratch=scratch)

    assert_replay_equals_eager(step, xs, outs,
                               lambda x: quant_linear(x, packed, qtype, k, scratch=scratch),
                               lambda rows, seed: random_x(rows, k, seed=seed), seeds=(31, 32))


def test_argument_errors() -> None:
    from kernels.gguf_quant import dequantize_to, packed_row_bytes, quant_gemv, quant_linear

    k, n = 1024, 64
    packed = torch.zeros(n, packed_row_bytes(12, k), dtype=torch.uint8, device="cuda")
    x = torch.randn(2, k, device="cuda", dtype=BF16)
    bad = {
        "x must be torch.bfloat16": lambda: quant_gemv(x.float(), packed, 12),
        "packed must be torch.uint8": lambda: quant_gemv(x, packed.view(torch.int8), 12),
        "packed must be \\[N, 576\\]": lambda: quant_gemv(x, packed[:, :288].contiguous(), 12),
        "packed must be contiguous": lambda: quant_gemv(x, packed[::2], 12),
        "1 to 16 rows": lambda: quant_gemv(torch.randn(17, k, device="cuda", dtype=BF16),
                                           packed, 12),
        "no GPU kernel": lambda: quant_gemv(x, packed, 3),
        "out must be \\(2, 64\\)": lambda: quant_gemv(
            x, packed, 12, out=torch.empty(2, 63, device="cuda", dtype=BF16)),
        "out's rows must be contiguous": lambda: quant_gemv(
            x, packed, 12, out=torch.empty(64, 2, device="cuda", dtype=BF16).t()),
        "packed must start at a 16-byte": lambda: quant_gemv(
            x, torch.zeros(n * 576 + 8, dtype=torch.uint8, device="cuda")[8:].view(n, 576), 12),
        "must not overlap": lambda: quant_gemv(
            x, packed, 12, out=x.view(-1)[:128].view(2, 64)),
        "x must start at a 16-byte": lambda: quant_gemv(
            torch.randn(2 * k + 1, device="cuda", dtype=BF16)[1:].view(2, k), packed, 12),
        "out must have 64 rows": lambda: dequantize_to(
            packed, 12, torch.empty(63, k, device="cuda", dtype=BF16)),
        "multiple of 256": lambda: dequantize_to(
            packed, 12, torch.empty(n, 1000, device="cuda", dtype=BF16)),
        "x must be \\[M, 2048\\]": lambda: quant_linear(x, packed, 12, 2048),
        "scratch must hold": lambda: quant_linear(
            torch.randn(32, k, device="cuda", dtype=BF16), packed, 12, k,
            scratch=torch.empty(n * k - 1, device="cuda", dtype=BF16)),
    }
    for message, call in bad.items():
        with pytest.raises(ValueError, match=message):
            call()


# ---- the CUDA-core GEMV (1..4 rows, kernels/csrc/gguf_gemv_small.cu) ----

# Every K of the Qwen3-0.6B..8B projections (1024, 2048, 2560, 3072, 4096,
# 6144, 9728, 12288), and layouts of every kind (kernels.gguf_quant's
# _small_layout on 132 SMs): warps per tile W = 1 and 2 over several rounds of
# tiles (40000 x 256, x 512), 8 and 16 over three rounds (12288 x 2048, 6144 x
# 4096), 10 and 12 (9728, 3072, 6144), 3 and 5 (576, 1056); N not a multiple
# of the 8-row tile, K % 256 != 0 (Q8_0, Q4_0).
CUDA_CORE_SHAPES = [(4096, 1024), (1024, 2048), (6144, 2560), (1024, 3072), (2048, 6144),
                    (2560, 9728), (6144, 4096), (4096, 12288), (12288, 2048), (40000, 256),
                    (40000, 512), (1001, 1024), (37, 3072), (960, 576), (1536, 960), (33, 1056),
                    (5, 32)]
CUDA_CORE_ROWS = (1, 2, 3, 4)


@pytest.mark.parametrize(("qtype", "n", "k"), cases(CUDA_CORE_SHAPES))
def test_cuda_core_gemv_matches_gguf_dequantize_then_matmul(qtype: int, n: int, k: int) -> None:
    """The CUDA-core kernel called directly (NaN-poisoned out: every element
    written), within float32 accumulation of the exact product, the same bits
    twice, and what quant_gemv dispatches to for these rows."""
    from kernels.cuda_build import sm_count
    from kernels.gguf_quant import (
        CUDA_CORE_GEMV_ROWS,
        cuda_core_gemv_fits,
        quant_gemv,
        quant_gemv_cuda_cores,
    )

    packed, weight = packed_weight(qtype, n, k, seed=n * 5 + k + qtype)
    packed_before = packed.clone()
    weight64 = torch.from_numpy(weight).cuda().double()
    for rows in CUDA_CORE_ROWS:
        x = random_x(rows, k, seed=rows * 811 + n + k)
        if not cuda_core_gemv_fits(rows, n, k, qtype, sm_count(0)):
            with pytest.raises(ValueError, match="does not fit"):
                quant_gemv_cuda_cores(x, packed, qtype)
            continue
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=BF16)
        assert quant_gemv_cuda_cores(x, packed, qtype, out=out) is out
        torch.cuda.synchronize()
        assert_close_to_exact(out, x, weight64, f"CUDA cores {TYPES[qtype]} {n}x{k} M={rows}")
        again = quant_gemv_cuda_cores(x, packed, qtype)
        assert torch.equal(again, out), "not deterministic"
        if rows <= CUDA_CORE_GEMV_ROWS.get(qtype, 0):
            # Within the measured rule, quant_gemv dispatches here.
            assert torch.equal(quant_gemv(x, packed, qtype), out), \
                "quant_gemv took another kernel"
    assert torch.equal(packed, packed_before)


@pytest.mark.parametrize("qtype", list(TYPES), ids=list(TYPES.values()))
def test_cuda_core_gemv_row_slices_into_a_column_range(qtype: int) -> None:
    """packed[first:last] of a larger tensor (only 2-byte aligned for Q8_0,
    Q4_0 at K = 1056 and Q6_K at K = 768: rows of 1122, 594 and 630 bytes)
    into out[:, first:last] of a wider output: the same bits as the whole
    weight's call (K has at most 8 units: the same warps sum each row) and
    nothing written outside the columns."""
    from kernels.gguf_quant import quant_gemv_cuda_cores

    n, k = 1000, 1056 if qtype in (2, 8) else 768
    packed, weight = packed_weight(qtype, n, k, seed=qtype + 77)
    weight64 = torch.from_numpy(weight).cuda().double()
    bounds = [0, 1, 3, 38, 501, 997, n]
    for rows in CUDA_CORE_ROWS:
        x = random_x(rows, k, seed=rows + 3)
        whole = quant_gemv_cuda_cores(x, packed, qtype)
        wide = torch.full((rows, n + 64), float("nan"), device="cuda", dtype=BF16)
        out = wide[:, 32:32 + n]
        for first, last in itertools.pairwise(bounds):
            part = packed[first:last]
            if qtype in (2, 8, 14) and first % 2:
                assert part.data_ptr() % 4 == 2  # the misaligned case is covered
            quant_gemv_cuda_cores(x, part, qtype, out=out[:, first:last])
        torch.cuda.synchronize()
        assert torch.equal(out, whole), f"M={rows}: a row slice differs from the whole call"
        assert wide[:, :32].isnan().all() and wide[:, 32 + n:].isnan().all(), "wrote outside out"
        assert_close_to_exact(out, x, weight64, f"{TYPES[qtype]} slices M={rows}")


@pytest.mark.parametrize("qtype", list(TYPES), ids=list(TYPES.values()))
def test_cuda_core_gemv_graph_replay_equals_eager(qtype: int) -> None:
    """M = 1..4 captured with preallocated outputs, replayed after x changes in
    place: the eager bits; no allocation in out= calls."""
    from kernels.gguf_quant import quant_gemv_cuda_cores

    n, k = 4104, 2048  # 513 tiles of 8 rows
    packed, _ = packed_weight(qtype, n, k, seed=23)
    xs = {rows: random_x(rows, k, seed=rows) for rows in CUDA_CORE_ROWS}
    outs = {rows: torch.empty(rows, n, device="cuda", dtype=BF16) for rows in xs}

    def step() -> None:
        for rows, x in xs.items():
            quant_gemv_cuda_cores(x, packed, qtype, out=outs[rows])

    assert_replay_equals_eager(step, xs, outs, lambda x: quant_gemv_cuda_cores(x, packed, qtype),
                               lambda rows, seed: random_x(rows, k, seed=seed), seeds=(41, 42))


def test_quant_gemv_picks_the_kernel_by_rows() -> None:
    """Up to CUDA_CORE_GEMV_ROWS[type] rows on the CUDA cores (same bits as
    calling it), more on the tensor cores; the CUDA-core entry refuses what
    it cannot take."""
    from kernels.gguf_quant import (
        CUDA_CORE_GEMV_ROWS,
        quant_gemv,
        quant_gemv_cuda_cores,
        quant_gemv_tensor_cores,
    )

    n, k = 512, 2048
    for qtype in (12, 8):  # Q4_K: one row on the CUDA cores; Q8_0: none
        packed, _ = packed_weight(qtype, n, k, seed=9)
        for rows in range(1, 17):
            x = random_x(rows, k, seed=rows)
            expected = (quant_gemv_cuda_cores if rows <= CUDA_CORE_GEMV_ROWS[qtype]
                        else quant_gemv_tensor_cores)(x, packed, qtype)
            assert torch.equal(quant_gemv(x, packed, qtype), expected), f"M={rows}"
    packed, _ = packed_weight(12, n, k, seed=9)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        quant_gemv_cuda_cores(random_x(5, k, seed=5), packed, 12)
    big_k = 16384  # 4 rows of float32 x take 278 KB of shared memory
    wide, _ = packed_weight(8, 16, big_k, seed=1)
    with pytest.raises(ValueError, match="does not fit"):
        quant_gemv_cuda_cores(random_x(4, big_k, seed=4), wide, 8)
    # quant_gemv still serves it, on the tensor cores.
    x = random_x(4, big_k, seed=4)
    assert torch.equal(quant_gemv(x, wide, 8), quant_gemv_tensor_cores(x, wide, 8))
