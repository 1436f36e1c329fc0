"""The torch reference ops against direct formulas and transformers' own code."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import (
    add_rms_norm,
    apply_rope,
    build_rope_cache,
    paged_attention,
    rms_norm,
    silu_and_mul,
    write_kv_cache,
)

# Two cores shared with other processes: one torch thread is faster and steadier.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEAD_DIM = 32
NUM_KV_HEADS = 2
# (cached tokens after the step, new tokens in the step) per sequence: a first
# decode token, decode rows at and across page boundaries, a whole prompt, and
# prefill chunks over a cached prefix that start and end mid-page.
MIXED_BATCH = [(1, 1), (17, 1), (33, 33), (40, 7), (16, 16), (5, 3), (64, 1), (23, 9)]


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Naive float64 attention of q [Q, Hq, D] (the last Q positions) over contiguous k, v [L, Hkv, D]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_paged(
    batch: list[tuple[int, int]], num_heads: int, page_size: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged_attention output, dense reference) for a batch laid out over shuffled pages."""
    gen = torch.Generator().manual_seed(1234)
    pages_per_seq = [-(-seq_len // page_size) for seq_len, _ in batch]
    num_pages = sum(pages_per_seq) + 3
    # Pages handed out in a shuffled order, so no sequence owns a contiguous run.
    order = torch.randperm(num_pages, generator=gen).tolist()
    # NaN in every slot that is never written: reading past a sequence poisons the output.
    cache_shape = (num_pages, page_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(cache_shape, math.nan, dtype=dtype)
    v_cache = torch.full(cache_shape, math.nan, dtype=dtype)
    block_tables = torch.zeros(len(batch), max(pages_per_seq), dtype=torch.int32)
    queries, expected, starts = [], [], [0]
    for b, (seq_len, q_len) in enumerate(batch):
        pages = [order.pop() for _ in range(pages_per_seq[b])]
        block_tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        slots = torch.tensor(
            [pages[p // page_size] * page_size + p % page_size for p in range(seq_len)]
        )
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        write_kv_cache(k, v, k_cache, v_cache, slots)
        q = torch.randn(q_len, num_heads, HEAD_DIM, generator=gen).to(dtype)
        queries.append(q)
        expected.append(dense_causal_attention(q, k, v, HEAD_DIM**-0.5))
        starts.append(starts[-1] + q_len)
    out = paged_attention(
        torch.cat(queries),
        k_cache,
        v_cache,
        tuple(starts),
        tuple(s for s, _ in batch),
        block_tables,
        HEAD_DIM**-0.5,
    )
    return out, torch.cat(expected)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_attention_matches_dense_causal_attention(group: int, page_size: int) -> None:
    out, expected = run_paged(MIXED_BATCH, NUM_KV_HEADS * group, page_size)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_paged_attention_single_sequence_kinds() -> None:
    # Each kind alone, so a failure names the case rather than the whole batch.
    for case in [(1, 1), (37, 1), (16, 16), (37, 5), (48, 16)]:
        out, expected = run_paged([case], 8, 16)
        torch.testing.assert_close(
            out.double(), expected, atol=2e-5, rtol=1e-5, msg=lambda m, c=case: f"{c}: {m}"
        )


def test_paged_attention_bf16_accumulates_in_float32() -> None:
    out, expected = run_paged(MIXED_BATCH, 4, 16, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # One bf16 rounding of the output (inputs are rounded alike on both sides).
    torch.testing.assert_close(out.double(), expected, atol=1.6e-2, rtol=1e-2)


def test_write_kv_cache_fills_exactly_the_mapped_slots() -> None:
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([13, 2, 7]))
    torch.testing.assert_close(k_cache[3, 1], k[0], rtol=0, atol=0)
    torch.testing.assert_close(v_cache[0, 2], v[1], rtol=0, atol=0)
    torch.testing.assert_close(k_cache[1, 3], k[2], rtol=0, atol=0)
    assert k_cache.count_nonzero() == k.count_nonzero()


def test_a_slot_of_minus_one_writes_nothing() -> None:
    """As our kernels' padding rows: the other rows land, nothing else moves."""
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([13, -1, 7]))
    torch.testing.assert_close(k_cache[3, 1], k[0], rtol=0, atol=0)
    torch.testing.assert_close(v_cache[1, 3], v[2], rtol=0, atol=0)
    assert k_cache.count_nonzero() == k[0].count_nonzero() + k[2].count_nonzero()


# -- rotary embeddings ---------------------------------------------------------

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_rotary(head_dim: int, theta: float, scaling: dict | None, positions: torch.Tensor):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_parameters = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    rotary = LlamaRotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=torch.float32), positions[None])


@pytest.mark.parametrize(
    ("theta", "scaling"),
    [
        (10000.0, None),
        (500000.0, LLAMA3_SCALING),
        (10000.0, {"rope_type": "linear", "factor": 4.0}),
    ],
    ids=["default", "llama3", "linear"],
)
def test_rope_matches_transformers(theta: float, scaling: dict | None) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim = 64
    positions = torch.tensor([0, 1, 5, 127, 128, 4095, 8191, 20000, 100000])
    cache = build_rope_cache(head_dim, 100001, theta, scaling, "cpu", torch.float32)
    q = torch.randn(len(positions), 4, head_dim)
    k = torch.randn(len(positions), 2, head_dim)
    ours_q, ours_k = apply_rope(positions, q, k, cache)

    cos, sin = hf_rotary(head_dim, theta, scaling, positions)
    # HF works on [batch, heads, seq, dim].
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_rope_freq_factors_reproduce_llama3_scaling() -> None:
    # llama.cpp's converter stores llama3 scaling as per-frequency divisors
    # (rope_freqs.weight); built from the same parameters they must agree.
    head_dim, theta = 64, 500000.0
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2).double() / head_dim)
    wavelen = 2 * math.pi / base
    low, high = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    factors = torch.where(
        wavelen < high, 1.0, torch.where(wavelen > low, 32.0, 1 / ((1 - smooth) / 32.0 + smooth))
    )
    ours = build_rope_cache(
        head_dim,
        9000,
        theta,
        {"rope_type": "freq_factors", "factors": factors.tolist()},
        "cpu",
        torch.float32,
    )
    llama3 = build_rope_cache(head_dim, 9000, theta, LLAMA3_SCALING, "cpu", torch.float32)
    torch.testing.assert_close(ours, llama3, atol=2e-4, rtol=0)


def test_rope_rejects_unknown_scaling() -> None:
    with pytest.raises(ValueError, match="yarn"):
        build_rope_cache(
            64, 16, 10000.0, {"rope_type": "yarn", "factor": 4.0}, "cpu", torch.float32
        )


# -- norms and activation --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_formula_and_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = (torch.randn(5, 3, 96) * 3).to(dtype)
    weight = torch.randn(96).to(dtype)
    x64 = x.double()
    formula = weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    ours = rms_norm(x, weight, 1e-5)
    assert ours.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.double(), formula, atol=tol, rtol=tol)

    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    hf.weight.data.copy_(weight)
    torch.testing.assert_close(ours, hf(x), atol=0, rtol=0)


def test_add_rms_norm_returns_normed_sum_and_sum() -> None:
    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    expected_sum = x + residual
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
    expected = weight * expected_sum / torch.sqrt(expected_sum.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_is_swiglu() -> None:
    x = torch.randn(3, 7, 2 * 48)
    gate, up = x[..., :48], x[..., 48:]
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul(x), expected, atol=1e-6, rtol=1e-5)
    assert silu_and_mul(x).shape == (3, 7, 48)
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, atol=0, rtol=0)
