"""An fp8 KV cache (float8 e4m3, per-tensor scales) in our kernels.

Writers (rope_cache.cu, gated_rope_cache.cu): an fp8 cache holds exactly
torch's e4m3 of (the bf16 values the bf16 kernel writes) / scale, saturated
at +-448 (kernels.reference.quantize_fp8), and nothing else changes.

Readers (decode_attention.cu, prefill_attention.cu): on an fp8 cache the
output equals the same kernel's on a bf16 cache holding the dequantized
values (e4m3 value * scale: exact in bf16 for the power-of-two scales used
here): the fp8 kernels widen to those very bf16 values in the same
registers / shared-memory tiles, so the math is the bf16 kernel's (the
tolerance is only a margin), and the fp8 path adds no error of its own
beyond e4m3's rounding. Subnormal codes get tests of their own: CuPy
compiles with -ftz=true, which once read them as zeros. Against the
original bf16 K/V the output stays within (2^-4 + 2^-7) * max|V| (max abs):
e4m3's relative rounding of V (at most 2^-4) bounds V's share, 2^-7 covers
the bf16 rounding of both outputs, and K's rounding changes the softmax
weights only a little (measured with the torch reference on unit-normal
data, head dims 64-256, 1-2000 tokens: the whole error at most 0.037 * max|V|).
Run on the lent GPU: pytest -m gpu tests/kernels/test_fp8_kv_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from kernels.decode_attention import decode_workspace, paged_decode_attention
from kernels.gated_rope_cache import gated_rope_and_cache
from kernels.prefill_attention import _prefill_attention, paged_prefill_attention
from kernels.reference import quantize_fp8
from kernels.rope_cache import rope_and_cache
from tests.kernels.test_decode_attention_gpu import make_case, random_lens
from tests.kernels.test_prefill_attention_gpu import MIXED, Batch

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
FP8 = torch.float8_e4m3fn
PAGE_SIZE = 16
MAX_POSITIONS = 4096
EPS = 1e-6
# (k_scale, v_scale): the engine's 1.0, and powers of two (dequantized values
# stay exact in bf16, so the bf16 comparison kernel sees the very values).
SCALES = [(1.0, 1.0), (0.5, 4.0)]
# Max abs error of fp8 K/V attention against bf16 K/V, in units of max|V|.
ERROR_BOUND = 2.0**-4 + 2.0**-7


def bytes_of(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def dequantize(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return (cache.float() * scale).to(torch.bfloat16)


def writer_inputs(tokens: int, width: int, seed: int) -> torch.Tensor:
    """bf16 rows of every magnitude e4m3 meets: normal, subnormal (below
    2^-6) and past 448 (saturated), and exact zeros."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, width, device="cuda", generator=g)
    magnitude = torch.tensor([3.0, 1e-3, 2000.0, 0.0], device="cuda")
    x = x * magnitude[torch.arange(tokens, device="cuda") % 4, None]
    return x.to(torch.bfloat16)


def slots(tokens: int, pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    mapping = torch.randperm(pages * PAGE_SIZE, device="cuda", generator=g)[:tokens]
    if tokens > 1:
        mapping[0] = -1  # a padding row: not written
    return mapping


def check_written(fp8_caches: tuple[torch.Tensor, ...], bf16_caches: tuple[torch.Tensor, ...],
                  scales: tuple[float, float]) -> None:
    for fp8_cache, bf16_cache, scale in zip(fp8_caches, bf16_caches, scales, strict=True):
        # Unwritten slots stay zero in both; written ones are e4m3(x / scale).
        expected = quantize_fp8(bf16_cache, scale)
        assert torch.equal(bytes_of(fp8_cache), bytes_of(expected))


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rope_cache_writes_the_e4m3_of_the_bf16_values(head_dim: int, norm: bool,
                                                       scales: tuple[float, float]) -> None:
    tokens, heads, kv_heads = 37, 8, 2
    qkv = writer_inputs(tokens, (heads + 2 * kv_heads) * head_dim, seed=head_dim)
    positions = torch.arange(tokens, device="cuda") * 7
    rope = reference.build_rope_cache(head_dim, MAX_POSITIONS, 1e6, None, "cuda", torch.bfloat16)
    pages = -(-2 * tokens // PAGE_SIZE)
    mapping = slots(tokens, pages, seed=1)
    weights = [torch.rand(head_dim, device="cuda").to(torch.bfloat16) + 0.5 if norm else None
               for _ in range(2)]
    shape = (pages, PAGE_SIZE, kv_heads, head_dim)
    results = {}
    for dtype in (torch.bfloat16, FP8):
        caches = (torch.zeros(shape, dtype=dtype, device="cuda"),
                  torch.zeros(shape, dtype=dtype, device="cuda"))
        q = rope_and_cache(qkv, positions, rope, *caches, mapping, heads, kv_heads, *weights, EPS,
                           k_scale=scales[0], v_scale=scales[1])
        results[dtype] = (q, caches)
    torch.cuda.synchronize()
    assert torch.equal(results[FP8][0], results[torch.bfloat16][0])
    check_written(results[FP8][1], results[torch.bfloat16][1], scales)


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("dims", [(256, 64), (128, 128), (64, 16)], ids=str)
def test_gated_rope_cache_writes_the_e4m3_of_the_bf16_values(
        dims: tuple[int, int], scales: tuple[float, float]) -> None:
    head_dim, rotary_dim = dims
    tokens, heads, kv_heads = 37, 8, 2
    projected = writer_inputs(tokens, 2 * (heads + kv_heads) * head_dim, seed=head_dim)
    positions = torch.arange(tokens, device="cuda") * 5
    rope = reference.build_rope_cache(rotary_dim, MAX_POSITIONS, 1e7, None, "cuda",
                                      torch.bfloat16)
    pages = -(-2 * tokens // PAGE_SIZE)
    mapping = slots(tokens, pages, seed=2)
    weights = [(0.2 * torch.randn(head_dim, device="cuda")).to(torch.bfloat16) for _ in range(2)]
    shape = (pages, PAGE_SIZE, kv_heads, head_dim)
    results = {}
    for dtype in (torch.bfloat16, FP8):
        caches = (torch.zeros(shape, dtype=dtype, device="cuda"),
                  torch.zeros(shape, dtype=dtype, device="cuda"))
        q = gated_rope_and_cache(projected, positions, rope, *caches, mapping, heads, kv_heads,
                                 *weights, EPS, k_scale=scales[0], v_scale=scales[1])
        results[dtype] = (q, caches)
    torch.cuda.synchronize()
    assert torch.equal(results[FP8][0], results[torch.bfloat16][0])
    check_written(results[FP8][1], results[torch.bfloat16][1], scales)


def assert_within_bound(out_fp8: torch.Tensor, out_bf16: torch.Tensor,
                        v_cache: torch.Tensor) -> None:
    v_max = v_cache.float().nan_to_num(0.0).abs().max().item()
    error = (out_fp8.float() - out_bf16.float()).abs().max().item()
    assert error <= ERROR_BOUND * v_max, (error, v_max)


def assert_same_sums(got: torch.Tensor, expected: torch.Tensor, v: torch.Tensor) -> None:
    """Equal up to float32 summation order: a bf16 ulp or two of each
    output, or 2^-10 of the largest |V| for outputs near zero."""
    bound = 2**-10 * float(v.float().nan_to_num().abs().max())
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=bound)


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_on_fp8_equals_decode_on_its_dequantized_values(
        head_dim: int, group: int, scales: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(head_dim + group)
    lens = random_lens(8, PAGE_SIZE, 700, gen)
    case = make_case(lens, 2, group, head_dim, PAGE_SIZE, seed=head_dim * group)
    k_scale, v_scale = scales
    # NaN slots (never read) become e4m3 NaN, and NaN again dequantized.
    k8, v8 = quantize_fp8(case.k_cache, k_scale), quantize_fp8(case.v_cache, v_scale)
    k_deq, v_deq = dequantize(k8, k_scale), dequantize(v8, v_scale)
    batch = len(lens)
    workspace = decode_workspace(batch, case.q.shape[1], head_dim, 4096, DEVICE)
    scale = head_dim**-0.5

    def run(k: torch.Tensor, v: torch.Tensor, **scales_given: float) -> torch.Tensor:
        out = torch.full_like(case.q, math.nan)
        paged_decode_attention(case.q, k, v, case.block_tables, case.seq_lens, scale, 4096,
                               workspace, out=out, **scales_given)
        torch.cuda.synchronize()
        return out

    out_fp8 = run(k8, v8, k_scale=k_scale, v_scale=v_scale)
    assert not out_fp8.isnan().any()
    assert_same_sums(out_fp8, run(k_deq, v_deq), v_deq)
    assert_within_bound(out_fp8, run(case.k_cache, case.v_cache), case.v_cache)


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize(("head_dim", "variant"),
                         [(64, "w32"), (64, "w16"), (128, "w32"), (128, "w16"), (256, "w16")])
@pytest.mark.parametrize("heads", [(8, 8), (16, 2), (32, 2)], ids=str)
def test_prefill_on_fp8_equals_prefill_on_its_dequantized_values(
        heads: tuple[int, int], head_dim: int, variant: str,
        scales: tuple[float, float]) -> None:
    batch = Batch(MIXED, heads[0], heads[1], head_dim, PAGE_SIZE, seed=head_dim)
    k_scale, v_scale = scales
    k8, v8 = quantize_fp8(batch.k_cache, k_scale), quantize_fp8(batch.v_cache, v_scale)
    k_deq, v_deq = dequantize(k8, k_scale), dequantize(v8, v_scale)

    def run(k: torch.Tensor, v: torch.Tensor, **scales_given: float) -> torch.Tensor:
        out = torch.full_like(batch.q, math.nan)
        _prefill_attention(batch.q, k, v, batch.query_start_loc, batch.seq_lens_t,
                           batch.block_tables, batch.scale, batch.max_query_len, out,
                           variant=variant, **scales_given)
        torch.cuda.synchronize()
        return out

    out_fp8 = run(k8, v8, k_scale=k_scale, v_scale=v_scale)
    assert not out_fp8.isnan().any()
    assert_same_sums(out_fp8, run(k_deq, v_deq), v_deq)
    assert_within_bound(out_fp8, run(batch.k_cache, batch.v_cache), batch.v_cache)


def read_fp8(reader: str, q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
             seq_lens: torch.Tensor, tables: torch.Tensor,
             scales: tuple[float, float]) -> torch.Tensor:
    """One query token a row (the row's last position) over fp8 caches, by the
    decode kernel or the prefill one."""
    scale = q.shape[-1] ** -0.5
    k_scale, v_scale = scales
    if reader == "decode":
        workspace = decode_workspace(q.shape[0], q.shape[1], q.shape[2], 64, DEVICE)
        out = paged_decode_attention(q, k8, v8, tables, seq_lens, scale, 64, workspace,
                                     k_scale=k_scale, v_scale=v_scale)
    else:
        starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=DEVICE)
        out = paged_prefill_attention(q, k8, v8, starts, seq_lens, tables, scale, 1,
                                      k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    return out


def fp8_pages(codes: torch.Tensor, rows: int) -> torch.Tensor:
    """A [rows, PAGE_SIZE, 2, D] fp8 cache whose page r starts with codes[r]
    ([tokens, 2, D] e4m3 codes, uint8); the other slots hold zeros."""
    cache = torch.zeros((rows, PAGE_SIZE, *codes.shape[2:]), dtype=torch.uint8, device=DEVICE)
    cache[:, : codes.shape[1]] = codes
    return cache.view(FP8)


# Every e4m3 code but the two NaNs (0x7f, 0xff), which the writers never store.
FINITE_CODES = [code for code in range(256) if code & 0x7F != 0x7F]


@pytest.mark.parametrize("scales", [*SCALES, (0.3, 1.7)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("reader", ["decode", "prefill"])
def test_every_finite_value_code_is_read_as_its_value(
        reader: str, head_dim: int, scales: tuple[float, float]) -> None:
    """A one-token row's output is its V row: bf16(value * v_scale) exactly,
    subnormal codes (0x01-0x07, 0x81-0x87) included. Reading e4m3 through a
    float's subnormals read them as 0: CuPy compiles with -ftz=true."""
    rows, group = 8, 4
    gen = torch.Generator().manual_seed(head_dim)
    count = rows * 2 * head_dim
    # Each code at least once (count >= 254), at shuffled positions.
    codes = torch.tensor(FINITE_CODES, dtype=torch.uint8).repeat(-(-count // 254))[:count]
    codes = codes[torch.randperm(count, generator=gen)]
    v8 = fp8_pages(codes.view(rows, 1, 2, head_dim).to(DEVICE), rows)
    k8 = quantize_fp8(torch.randn((rows, PAGE_SIZE, 2, head_dim), generator=gen), 0.5).to(DEVICE)
    q = torch.randn((rows, 2 * group, head_dim), generator=gen).to(DEVICE, torch.bfloat16)
    tables = torch.arange(rows, dtype=torch.int32, device=DEVICE)[:, None]
    seq_lens = torch.ones(rows, dtype=torch.int32, device=DEVICE)
    out = read_fp8(reader, q, k8, v8, seq_lens, tables, scales)
    expected = dequantize(v8[:, 0], scales[1]).repeat_interleave(group, dim=1)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("reader", ["decode", "prefill"])
def test_subnormal_key_codes_weigh_in_the_scores(
        reader: str, head_dim: int, scales: tuple[float, float]) -> None:
    """Two keys: zeros, and subnormal codes only (1-7: 2^-9 to 7 * 2^-9).
    Their values are +1 and -1, so the output, 1 - 2 * softmax weight of the
    second key, is 0 when the subnormals are read as zeros."""
    rows, group = 4, 4
    k_scale, v_scale = scales
    gen = torch.Generator().manual_seed(head_dim + 1)
    keys = torch.zeros((rows, 2, 2, head_dim), dtype=torch.uint8)
    keys[:, 1] = torch.randint(1, 8, (rows, 2, head_dim), generator=gen, dtype=torch.uint8)
    values = torch.zeros_like(keys)
    values[:, 0], values[:, 1] = 0x38, 0xB8  # e4m3 1.0, -1.0
    k8, v8 = fp8_pages(keys.to(DEVICE), rows), fp8_pages(values.to(DEVICE), rows)
    q = torch.full((rows, 2 * group, head_dim), 16.0, dtype=torch.bfloat16, device=DEVICE)
    tables = torch.arange(rows, dtype=torch.int32, device=DEVICE)[:, None]
    seq_lens = torch.full((rows,), 2, dtype=torch.int32, device=DEVICE)
    out = read_fp8(reader, q, k8, v8, seq_lens, tables, scales)
    # Score difference of the two keys: q . k (the first key is zero).
    score = keys[:, 1].double().mul(2.0**-9).sum(-1) * 16.0 * k_scale * head_dim**-0.5
    weight = torch.sigmoid(score).repeat_interleave(group, dim=1)
    expected = ((1.0 - 2.0 * weight) * v_scale)[..., None].expand(out.shape)
    assert float(expected.abs().min()) > 0.1 * v_scale  # far from the flushed 0
    torch.testing.assert_close(out.double(), expected.to(DEVICE), rtol=0, atol=2**-6 * v_scale)


def test_mixed_cache_dtypes_and_bad_scales_are_refused() -> None:
    case = make_case([5], 2, 4, 128, PAGE_SIZE, seed=0)
    workspace = decode_workspace(1, 8, 128, 64, DEVICE)
    k8 = quantize_fp8(case.k_cache, 1.0)
    with pytest.raises(ValueError, match=r"v_cache must be torch\.float8_e4m3fn"):
        paged_decode_attention(case.q, k8, case.v_cache, case.block_tables, case.seq_lens,
                               0.1, 64, workspace)
    with pytest.raises(ValueError, match="k_scale must be a positive, finite number"):
        paged_decode_attention(case.q, k8, quantize_fp8(case.v_cache, 1.0), case.block_tables,
                               case.seq_lens, 0.1, 64, workspace, k_scale=0.0)
