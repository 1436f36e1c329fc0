"""kernels.rope_cache (q/k norm + RoPE + paged KV write) against kernels.reference.

Without q/k norm the rotation rounds exactly as the reference's bf16 ops, so q
and the cached k must be bitwise equal; v is a copy. With the norm, only the
norm's variance (summed in another order) may flip a few elements. Cache rows
that no token writes (negative slots, the rest of the pool) must be untouched.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import reference

pytestmark = pytest.mark.gpu

HEAD_DIMS = [64, 128, 256]  # 256: Qwen3-Next's and Qwen3.5's full attention
HEADS = [(16, 8), (32, 8), (9, 3), (4, 4), (16, 2)]
TOKENS = [1, 7, 256, 2048]
MAX_POSITIONS = 40960
PAGE_SIZE = 16
EPS = 1e-6


@functools.cache
def cos_sin_cache(head_dim: int) -> torch.Tensor:
    return reference.build_rope_cache(head_dim, MAX_POSITIONS, 1e6, None, "cuda", torch.bfloat16)


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns mapped to integers that step by one per ulp across zero."""
    bits = x.contiguous().view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_nearly_bitwise(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to ref except a tiny fraction of elements (norm variance order):
    a 1-ulp change of a normalized value can move a rotated difference by
    several ulps of the (small) result, so only the count is bounded here and
    the size of the error by the float64 comparison."""
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN elements"
    differing = int((ordered_bits(out) != ordered_bits(ref)).sum())
    assert differing <= 2 + 1e-3 * out.numel(), f"{differing} of {out.numel()} elements differ"


def assert_close_to_float64(out: torch.Tensor, exact: torch.Tensor) -> None:
    error = (out.double() - exact).norm() / exact.norm()
    assert error < 1e-2, f"relative error {error:.2e}"


def float64_reference(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """rope(norm(x)) in float64 from the same bf16 inputs; x [T, H, D], cos/sin [T, 1, D/2]."""
    x = x.double()
    if weight is not None:
        x = weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.double(), sin.double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Case:
    """Random inputs for one call, the caches before it, and the reference results."""

    def __init__(self, tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 with_norm: bool, seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.tokens, self.num_heads, self.num_kv_heads, self.head_dim = (
            tokens, num_heads, num_kv_heads, head_dim)
        width = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv = (torch.randn(tokens, width, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        self.positions = torch.randint(0, MAX_POSITIONS, (tokens,), device="cuda", generator=gen)
        # A shuffled pool about twice the batch; distinct random slots in it.
        pages = -(-2 * tokens // PAGE_SIZE) + 1
        self.slot_mapping = torch.randperm(pages * PAGE_SIZE, device="cuda", generator=gen)[:tokens]
        if tokens > 1:  # padding rows: not cached (at least one, never all)
            skipped = torch.rand(tokens, device="cuda", generator=gen) < 0.25
            skipped[0], skipped[-1] = True, False
            self.slot_mapping = torch.where(skipped, -1, self.slot_mapping)
        shape = (pages, PAGE_SIZE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
        self.v_cache = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
        self.q_norm_weight = self.k_norm_weight = None
        if with_norm:
            self.q_norm_weight = (1 + 0.5 * torch.randn(head_dim, device="cuda", generator=gen)).to(
                torch.bfloat16)
            self.k_norm_weight = (1 + 0.5 * torch.randn(head_dim, device="cuda", generator=gen)).to(
                torch.bfloat16)

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv.split([q_width, kv_width, kv_width], dim=-1)
        return (q.reshape(self.tokens, self.num_heads, self.head_dim),
                k.reshape(self.tokens, self.num_kv_heads, self.head_dim),
                v.reshape(self.tokens, self.num_kv_heads, self.head_dim))

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_out, k_cache, v_cache) as the reference ops leave them."""
        q, k, v = self.split()
        if self.q_norm_weight is not None:
            q = reference.rms_norm(q, self.q_norm_weight, EPS)
            k = reference.rms_norm(k, self.k_norm_weight, EPS)
        q, k = reference.apply_rope(self.positions, q, k, cos_sin_cache(self.head_dim))
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        valid = self.slot_mapping >= 0
        reference.write_kv_cache(k[valid], v[valid], k_cache, v_cache, self.slot_mapping[valid])
        return q, k_cache, v_cache

    def float64(self) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self.split()
        cos, sin = cos_sin_cache(self.head_dim)[self.positions].unsqueeze(1).chunk(2, dim=-1)
        return (float64_reference(q, self.q_norm_weight, cos, sin),
                float64_reference(k, self.k_norm_weight, cos, sin))

    def run(self, q_out: torch.Tensor | None = None) -> torch.Tensor:
        from kernels.rope_cache import rope_and_cache

        return rope_and_cache(
            self.qkv, self.positions, cos_sin_cache(self.head_dim), self.k_cache, self.v_cache,
            self.slot_mapping, self.num_heads, self.num_kv_heads, self.q_norm_weight,
            self.k_norm_weight, EPS, q_out=q_out)


def check(case: Case, q_out: torch.Tensor, ref_q: torch.Tensor, ref_k_cache: torch.Tensor,
          ref_v_cache: torch.Tensor) -> None:
    torch.cuda.synchronize()
    hkv, d = case.num_kv_heads, case.head_dim
    k_rows, ref_k_rows = case.k_cache.view(-1, hkv, d), ref_k_cache.view(-1, hkv, d)
    # v is copied, and rows no token writes stay as they were: bitwise, always.
    assert torch.equal(case.v_cache, ref_v_cache)
    written = torch.zeros(k_rows.shape[0], dtype=torch.bool, device="cuda")
    valid_slots = case.slot_mapping[case.slot_mapping >= 0]
    written[valid_slots] = True
    assert torch.equal(k_rows[~written], ref_k_rows[~written])
    if case.q_norm_weight is None:
        assert torch.equal(q_out, ref_q)
        assert torch.equal(k_rows[written], ref_k_rows[written])
    else:
        assert_nearly_bitwise(q_out, ref_q)
        assert_nearly_bitwise(k_rows[valid_slots], ref_k_rows[valid_slots])
    exact_q, exact_k = case.float64()
    assert_close_to_float64(q_out, exact_q)
    valid = case.slot_mapping >= 0
    assert_close_to_float64(k_rows[valid_slots], exact_k[valid])


@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_reference(head_dim: int, heads: tuple[int, int], tokens: int,
                           with_norm: bool) -> None:
    num_heads, num_kv_heads = heads
    case = Case(tokens, num_heads, num_kv_heads, head_dim, with_norm,
                seed=tokens * 1009 + num_heads * 31 + num_kv_heads + head_dim + with_norm)
    qkv_before = case.qkv.clone()
    ref_q, ref_k_cache, ref_v_cache = case.reference()
    q_out = torch.full((tokens, num_heads, head_dim), float("nan"), device="cuda",
                       dtype=torch.bfloat16)
    result = case.run(q_out=q_out)
    assert result is q_out
    check(case, q_out, ref_q, ref_k_cache, ref_v_cache)
    assert torch.equal(case.qkv, qkv_before)


def test_allocates_q_out_when_not_given() -> None:
    case = Case(5, 16, 8, 128, True, seed=11)
    ref_q, ref_k_cache, ref_v_cache = case.reference()
    q_out = case.run()
    assert q_out.shape == (5, 16, 128) and q_out.dtype == torch.bfloat16
    check(case, q_out, ref_q, ref_k_cache, ref_v_cache)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_identity_rotation_copies_q_and_k(head_dim: int) -> None:
    # CudaOps's table for layers that rotate q/k themselves (Qwen3-Next's and
    # Qwen3.5's GatedAttention, head dim 256): cos 1, sin 0, every position 0.
    case = Case(64, 16, 2, head_dim, False, seed=18)
    case.positions.zero_()
    half = head_dim // 2
    identity = torch.cat([torch.ones(half), torch.zeros(half)]).to(
        device="cuda", dtype=torch.bfloat16).view(1, head_dim)
    from kernels.rope_cache import rope_and_cache

    q_out = rope_and_cache(case.qkv, case.positions, identity, case.k_cache, case.v_cache,
                           case.slot_mapping, 16, 2, None, None, EPS)
    torch.cuda.synchronize()
    q, k, v = case.split()
    valid = case.slot_mapping >= 0
    slots = case.slot_mapping[valid]
    assert torch.equal(q_out, q)
    assert torch.equal(case.k_cache.view(-1, 2, head_dim)[slots], k[valid])
    assert torch.equal(case.v_cache.view(-1, 2, head_dim)[slots], v[valid])


def test_all_padding_rows_write_nothing() -> None:
    case = Case(9, 16, 8, 128, True, seed=12)
    case.slot_mapping.fill_(-1)
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    ref_q, _, _ = case.reference()
    q_out = case.run()
    torch.cuda.synchronize()
    assert torch.equal(case.k_cache, k_before) and torch.equal(case.v_cache, v_before)
    assert_nearly_bitwise(q_out, ref_q)


def test_out_of_range_contents_never_touch_memory_outside() -> None:
    """Contents cannot be checked without a sync: a slot past the cache's end is
    skipped and a position past the table gives NaN, with no stray access."""
    case = Case(4, 16, 8, 64, False, seed=13)
    num_slots = case.k_cache.shape[0] * case.k_cache.shape[1]
    case.slot_mapping.copy_(torch.randperm(num_slots, device="cuda")[:4])
    case.slot_mapping[1] = num_slots  # one past the end
    case.positions[2] = MAX_POSITIONS
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    q_out = case.run()
    torch.cuda.synchronize()
    assert q_out[2].isnan().all()
    assert not q_out[[0, 1, 3]].isnan().any()
    untouched = torch.ones(num_slots, dtype=torch.bool, device="cuda")
    untouched[case.slot_mapping[[0, 2, 3]]] = False
    for after, before in ((case.k_cache, k_before), (case.v_cache, v_before)):
        assert torch.equal(after.view(num_slots, -1)[untouched],
                           before.view(num_slots, -1)[untouched])


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cuda_graph_replay(head_dim: int) -> None:
    """Captured with q_out given; replayed on new qkv, positions and slots."""
    case = Case(32, 16, 8, head_dim, True, seed=14)
    q_out = torch.empty(32, 16, head_dim, device="cuda", dtype=torch.bfloat16)
    case.run(q_out=q_out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(q_out=q_out)
    for seed in (15, 16):
        fresh = Case(32, 16, 8, head_dim, True, seed=seed)
        case.qkv.copy_(fresh.qkv)
        case.positions.copy_(fresh.positions)
        case.slot_mapping.copy_(fresh.slot_mapping)
        case.k_cache.copy_(fresh.k_cache)
        case.v_cache.copy_(fresh.v_cache)
        case.q_norm_weight.copy_(fresh.q_norm_weight)
        case.k_norm_weight.copy_(fresh.k_norm_weight)
        ref_q, ref_k_cache, ref_v_cache = case.reference()
        q_out.fill_(float("nan"))
        graph.replay()
        check(case, q_out, ref_q, ref_k_cache, ref_v_cache)


def test_bad_inputs_raise() -> None:
    from kernels.rope_cache import rope_and_cache

    case = Case(4, 16, 8, 128, True, seed=17)
    good = dict(
        qkv=case.qkv, positions=case.positions, cos_sin_cache=cos_sin_cache(128),
        k_cache=case.k_cache, v_cache=case.v_cache, slot_mapping=case.slot_mapping,
        num_heads=16, num_kv_heads=8, q_norm_weight=case.q_norm_weight,
        k_norm_weight=case.k_norm_weight, eps=EPS,
    )
    bf16 = torch.bfloat16
    pages, page_size, _, _ = case.k_cache.shape

    def cache(kv_heads: int, head_dim: int) -> torch.Tensor:
        return torch.randn(pages, page_size, kv_heads, head_dim, device="cuda").to(bf16)

    bad_arguments = [
        {"qkv": case.qkv.float()},
        {"qkv": case.qkv.cpu()},
        {"qkv": case.qkv[:, :-128]},  # not contiguous, and the wrong width
        {"qkv": case.qkv[:, :-128].contiguous()},
        {"num_heads": 12},  # not a multiple of Hkv, and the wrong width
        {"num_heads": 16, "num_kv_heads": 6},
        {"num_kv_heads": 0},
        {"positions": case.positions.int()},
        {"positions": case.positions[:3]},
        {"slot_mapping": case.slot_mapping.int()},
        {"slot_mapping": case.slot_mapping[:2]},
        {"cos_sin_cache": cos_sin_cache(64)},
        {"cos_sin_cache": cos_sin_cache(128).float()},
        {"k_cache": case.k_cache.float()},
        {"v_cache": case.v_cache[:, :8]},  # not contiguous, other shape
        {"v_cache": cache(8, 64)},
        {"k_cache": cache(4, 128), "v_cache": cache(4, 128)},
        {"k_cache": cache(8, 96), "v_cache": cache(8, 96)},
        {"q_norm_weight": case.q_norm_weight[:64]},
        {"k_norm_weight": case.k_norm_weight.float()},
        {"q_out": torch.empty(4, 8, 128, device="cuda", dtype=bf16)},
        {"q_out": torch.empty(4, 16, 128, device="cuda")},
        {"q_out": case.qkv.view(-1)[: 4 * 16 * 128].view(4, 16, 128)},  # overlaps qkv
    ]
    for changes in bad_arguments:
        with pytest.raises(ValueError):
            rope_and_cache(**{**good, **changes})
