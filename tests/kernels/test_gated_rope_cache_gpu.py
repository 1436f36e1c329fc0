"""kernels/gated_rope_cache.py (GatedAttention's q/k zero-centred norms +
partial RoPE + KV write, and its output gate) against kernels.hybrid_reference,
and CudaOps.gated_attention against the reference ops' composition of it.

The kernel does torch's float32 steps in torch's order; only the norm's
variance is summed in another order. With "grid" q/k (multiples of 1/8
below 2, whose squares sum exactly in any order) q and the cached k must be
bitwise the reference's; with random normal ones equal but for a tiny
fraction, and close to float64. v is a copy; rows no token writes stay.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import hybrid_reference, reference

pytestmark = pytest.mark.gpu

EPS = 1e-6
MAX_POSITIONS = 32768
PAGE_SIZE = 16
TOKENS = [1, 7, 300]
# (head_dim, rotary_dim): Qwen3.5's / Qwen3-Next's 64 of 256, the tiny GPU
# test models' 32 of 128, half and all of a head, the smallest part.
ROTARY = [(256, 64), (128, 32), (256, 128), (256, 256), (64, 16), (128, 128)]
HEADS = [(16, 2), (16, 4), (8, 8)]


@functools.cache
def cos_sin_cache(rotary_dim: int) -> torch.Tensor:
    return reference.build_rope_cache(rotary_dim, MAX_POSITIONS, 1e7, None, "cuda",
                                      torch.bfloat16)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_nearly_bitwise(out: torch.Tensor, ref: torch.Tensor, max_ulps: int | None = None
                          ) -> None:
    """A tiny fraction of elements may differ; with max_ulps None only the
    count is bounded (a normalized value one ulp apart can move a rotated
    difference by several ulps of the small result)."""
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN elements"
    ulps = (ordered_bits(out) - ordered_bits(ref)).abs()
    differing = int((ulps > 0).sum())
    assert differing <= 2 + 1e-3 * out.numel(), f"{differing} of {out.numel()} elements differ"
    if max_ulps is not None:
        assert int(ulps.max()) <= max_ulps, f"an element is {int(ulps.max())} ulps off"


class Case:
    """Random inputs of one call, the caches before it, and the reference."""

    def __init__(self, tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary_dim: int, grid: bool, seed: int) -> None:
        g = gen(seed)
        self.tokens, self.num_heads, self.num_kv_heads = tokens, num_heads, num_kv_heads
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        width = 2 * (num_heads + num_kv_heads) * head_dim
        if grid:
            whole = torch.randint(-16, 16, (tokens, width), device="cuda", generator=g)
            self.projected = (whole.float() / 8).to(torch.bfloat16)
        else:
            self.projected = (torch.randn(tokens, width, device="cuda", generator=g) * 3).to(
                torch.bfloat16)
        self.positions = torch.randint(0, MAX_POSITIONS, (tokens,), device="cuda", generator=g)
        pages = -(-2 * tokens // PAGE_SIZE) + 1
        self.slot_mapping = torch.randperm(pages * PAGE_SIZE, device="cuda", generator=g)[:tokens]
        if tokens > 1:  # padding rows, not cached: at least one, never all
            skipped = torch.rand(tokens, device="cuda", generator=g) < 0.25
            skipped[0], skipped[-1] = True, False
            self.slot_mapping = torch.where(skipped, -1, self.slot_mapping)
        shape = (pages, PAGE_SIZE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        self.v_cache = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        # Zero-centred: near 0 in checkpoints.
        self.q_norm_weight, self.k_norm_weight = (
            (0.2 * torch.randn(head_dim, device="cuda", generator=g)).to(torch.bfloat16)
            for _ in range(2))

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_out, k_cache, v_cache) as the reference leaves them."""
        q, k, v = hybrid_reference.gated_qk_norm_rope(
            self.projected, self.positions, cos_sin_cache(self.rotary_dim), self.q_norm_weight,
            self.k_norm_weight, self.num_heads, self.num_kv_heads, self.head_dim, EPS)
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        valid = self.slot_mapping >= 0
        reference.write_kv_cache(k[valid], v[valid].contiguous(), k_cache, v_cache,
                                 self.slot_mapping[valid])
        return q, k_cache, v_cache

    def run(self, q_out: torch.Tensor | None = None) -> torch.Tensor:
        from kernels.gated_rope_cache import gated_rope_and_cache

        return gated_rope_and_cache(
            self.projected, self.positions, cos_sin_cache(self.rotary_dim), self.k_cache,
            self.v_cache, self.slot_mapping, self.num_heads, self.num_kv_heads,
            self.q_norm_weight, self.k_norm_weight, EPS, q_out=q_out)

    def written(self) -> torch.Tensor:
        rows = self.k_cache.shape[0] * self.k_cache.shape[1]
        mask = torch.zeros(rows, dtype=torch.bool, device="cuda")
        mask[self.slot_mapping[self.slot_mapping >= 0]] = True
        return mask


def check(case: Case, q_out: torch.Tensor, ref: tuple[torch.Tensor, ...], exact: bool) -> None:
    torch.cuda.synchronize()
    ref_q, ref_k_cache, ref_v_cache = ref
    hkv, d = case.num_kv_heads, case.head_dim
    k_rows, ref_k_rows = case.k_cache.view(-1, hkv, d), ref_k_cache.view(-1, hkv, d)
    assert torch.equal(case.v_cache, ref_v_cache)
    written = case.written()
    assert torch.equal(k_rows[~written], ref_k_rows[~written])
    if exact:
        assert torch.equal(q_out, ref_q)
        assert torch.equal(k_rows, ref_k_rows)
    else:
        assert_nearly_bitwise(q_out, ref_q)
        assert_nearly_bitwise(k_rows[written], ref_k_rows[written])
        # The dims past rotary_dim are the norm's alone: one rounding, one ulp.
        r = case.rotary_dim
        if r < d:
            assert_nearly_bitwise(q_out[..., r:], ref_q[..., r:], 1)


@pytest.mark.parametrize("grid", [True, False], ids=["grid", "normal"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("dims", ROTARY, ids=lambda r: f"d{r[0]}r{r[1]}")
def test_matches_the_reference(dims: tuple[int, int], heads: tuple[int, int], tokens: int,
                               grid: bool) -> None:
    head_dim, rotary_dim = dims
    case = Case(tokens, *heads, head_dim, rotary_dim, grid,
                seed=tokens * 101 + heads[0] * 7 + heads[1] + head_dim + rotary_dim + grid)
    before = case.projected.clone()
    ref = case.reference()
    q_out = torch.full((tokens, heads[0], head_dim), float("nan"), device="cuda",
                       dtype=torch.bfloat16)
    assert case.run(q_out=q_out) is q_out
    check(case, q_out, ref, exact=grid)
    assert torch.equal(case.projected, before)


def test_the_unrotated_dims_are_only_normed() -> None:
    """Partial rotary: dims past rotary_dim are zc_norm(x) whatever the
    position, the rotated ones move with it."""
    case = Case(7, 16, 2, 256, 64, True, seed=3)
    q_at = []
    for position in (0, 1000):
        case.positions.fill_(position)
        q_at.append(case.run())
    torch.cuda.synchronize()
    assert torch.equal(q_at[0][..., 64:], q_at[1][..., 64:])
    assert not torch.equal(q_at[0][..., :64], q_at[1][..., :64])
    q, _, _, _ = hybrid_reference.split_gated_qkv(case.projected, 16, 2, 256)
    normed = hybrid_reference.zero_centred_rms_norm(q, case.q_norm_weight, EPS)
    assert torch.equal(q_at[0], normed)  # position 0: cos 1, sin 0


def test_out_of_range_slots_and_positions_touch_nothing_outside() -> None:
    case = Case(4, 16, 2, 256, 64, False, seed=5)
    num_slots = case.k_cache.shape[0] * case.k_cache.shape[1]
    case.slot_mapping.copy_(torch.randperm(num_slots, device="cuda")[:4])
    case.slot_mapping[1] = num_slots  # one past the end
    case.positions[2] = MAX_POSITIONS
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    q_out = case.run()
    torch.cuda.synchronize()
    assert q_out[2, :, :64].isnan().all() and not q_out[2, :, 64:].isnan().any()
    assert not q_out[[0, 1, 3]].isnan().any()
    untouched = torch.ones(num_slots, dtype=torch.bool, device="cuda")
    untouched[case.slot_mapping[[0, 2, 3]]] = False
    for after, before in ((case.k_cache, k_before), (case.v_cache, v_before)):
        assert torch.equal(after.view(num_slots, -1)[untouched],
                           before.view(num_slots, -1)[untouched])


def test_cuda_graph_replay() -> None:
    case = Case(8, 16, 2, 256, 64, True, seed=6)
    q_out = torch.empty(8, 16, 256, device="cuda", dtype=torch.bfloat16)
    case.run(q_out=q_out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(q_out=q_out)
    for seed in (7, 8):
        fresh = Case(8, 16, 2, 256, 64, True, seed=seed)
        for name in ("projected", "positions", "slot_mapping", "k_cache", "v_cache",
                     "q_norm_weight", "k_norm_weight"):
            getattr(case, name).copy_(getattr(fresh, name))
        ref = case.reference()
        q_out.fill_(float("nan"))
        graph.replay()
        check(case, q_out, ref, exact=True)


def test_bad_inputs_raise() -> None:
    from kernels.gated_rope_cache import gated_rope_and_cache, rotary_dim_supported

    assert rotary_dim_supported(256, 64) and rotary_dim_supported(256, 256)
    assert not rotary_dim_supported(256, 96) and not rotary_dim_supported(256, 192)
    assert not rotary_dim_supported(96, 32) and not rotary_dim_supported(256, 8)
    case = Case(4, 16, 2, 256, 64, False, seed=9)
    good = dict(projected=case.projected, positions=case.positions,
                cos_sin_cache=cos_sin_cache(64), k_cache=case.k_cache, v_cache=case.v_cache,
                slot_mapping=case.slot_mapping, num_heads=16, num_kv_heads=2,
                q_norm_weight=case.q_norm_weight, k_norm_weight=case.k_norm_weight, eps=EPS)
    bad_arguments = [
        {"projected": case.projected.float()},
        {"projected": case.projected[:, :-256]},  # not contiguous, and the wrong width
        {"projected": case.projected[:, :-512].contiguous()},
        {"num_heads": 12},
        {"num_kv_heads": 4},
        {"positions": case.positions.int()},
        {"slot_mapping": case.slot_mapping[:2]},
        {"cos_sin_cache": reference.build_rope_cache(96, 64, 1e7, None, "cuda", torch.bfloat16)},
        {"cos_sin_cache": cos_sin_cache(64).float()},
        {"q_norm_weight": case.q_norm_weight[:128]},
        {"k_norm_weight": case.k_norm_weight.float()},
        {"q_out": torch.empty(4, 8, 256, device="cuda", dtype=torch.bfloat16)},
        {"q_out": case.projected.view(-1)[: 4 * 16 * 256].view(4, 16, 256)},  # overlaps
    ]
    for changes in bad_arguments:
        with pytest.raises(ValueError):
            gated_rope_and_cache(**{**good, **changes})


# --- the output gate --------------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("in_place", [False, True])
def test_sigmoid_gate_mul_matches_torch(tokens: int, in_place: bool) -> None:
    from kernels.gated_rope_cache import sigmoid_gate_mul

    heads, kv_heads, d = 16, 2, 256
    projected = (torch.randn(tokens, 2 * (heads + kv_heads) * d, device="cuda",
                             generator=gen(tokens)) * 4).to(torch.bfloat16)
    attn = torch.randn(tokens, heads * d, device="cuda", generator=gen(tokens + 1)).to(
        torch.bfloat16)
    _, gate, _, _ = hybrid_reference.split_gated_qkv(projected, heads, kv_heads, d)
    expected = attn * torch.sigmoid(gate.reshape(tokens, heads * d))
    out = attn if in_place else torch.full_like(attn, float("nan"))
    assert sigmoid_gate_mul(attn, projected, heads, out=out) is out
    torch.cuda.synchronize()
    # torch's steps (sigmoid as 1 / (1 + exp(-x)) rounded to bf16, then the
    # bf16 product); expf against torch's may differ in float32's last bit,
    # which can flip the sigmoid's rounding and move the product by <= 2 ulps.
    assert_nearly_bitwise(out, expected, 2)


# --- CudaOps.gated_attention ------------------------------------------------------------


def _meta(seq_lens: list[int], new: list[int]) -> tuple[object, torch.Tensor, int]:
    """Metadata of a batch whose sequence b has seq_lens[b] tokens, the last
    new[b] of them in this step; (meta, positions, pages)."""
    from engine.execution.attention_metadata import AttentionMetadata

    pages_each = [-(-s // PAGE_SIZE) for s in seq_lens]
    width = max(pages_each)
    order = torch.randperm(sum(pages_each), generator=torch.Generator().manual_seed(0))
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_each):
        tables[b, :count] = order[used:used + count]
        used += count
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, new, strict=True)])
    slots = torch.cat([tables[b, p // PAGE_SIZE].long() * PAGE_SIZE + p % PAGE_SIZE
                       for b, (s, n) in enumerate(zip(seq_lens, new, strict=True))
                       for p in [torch.arange(s - n, s)]])
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), slot_mapping=slots.cuda(), max_query_len=max(new),
        max_seq_len=max(seq_lens), query_start_loc_host=tuple(starts),
        seq_lens_host=tuple(seq_lens))
    return meta, positions.cuda(), used


@pytest.mark.parametrize(("seq_lens", "new"), [([5, 17, 300], [1, 1, 1]),
                                               ([20, 7, 300], [20, 1, 300])],
                         ids=["decode", "prefill"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_cuda_ops_gated_attention_is_the_composed_path(seq_lens: list[int], new: list[int],
                                                       kv_heads: int) -> None:
    """The fused path (one kernel before attention, one after) against the
    reference composition run on the same CudaOps (torch norms and partial
    RoPE, then the attention kernels through the identity rotation)."""
    from engine.execution.model_ops import CudaOps, ReferenceOps
    from engine.models import ModelConfig
    from tests.perf.gpu_models import hf_config

    config = ModelConfig.from_hf_config({**hf_config("qwen3-0.6b"), "hidden_size": 2048,
                                         "num_attention_heads": 16,
                                         "num_key_value_heads": kv_heads, "head_dim": 256})
    ops = CudaOps(config, torch.device("cuda"), decode_batch=4, max_seq_len=512)
    meta, positions, pages = _meta(seq_lens, new)
    tokens = sum(new)
    width = 2 * config.q_size + 2 * config.kv_size
    whole = torch.randint(-16, 16, (tokens, width), device="cuda", generator=gen(kv_heads))
    projected = (whole.float() / 8).to(torch.bfloat16)  # grid: exact norms on both paths
    q_w, k_w = ((0.2 * torch.randn(256, device="cuda", generator=gen(i))).to(torch.bfloat16)
                for i in (1, 2))
    shape = config.kv_cache_shape(pages, PAGE_SIZE)
    caches = [tuple(torch.randn(shape, device="cuda", generator=gen(10 + i)).to(torch.bfloat16)
                    for i in (0, 1)) for _ in range(2)]
    caches[1] = (caches[0][0].clone(), caches[0][1].clone())
    rope = cos_sin_cache(64)
    fused = ops.gated_attention(config, projected, positions, meta, caches[0], rope, q_w, k_w)
    composed = ReferenceOps.gated_attention(ops, config, projected, positions, meta, caches[1],
                                            rope, q_w, k_w)
    torch.cuda.synchronize()
    assert fused.shape == (tokens, config.q_size)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    # The same q and caches into the same attention kernels: only the gate's
    # sigmoid (see test_sigmoid_gate_mul_matches_torch) may round apart.
    assert_nearly_bitwise(fused, composed, 2)
