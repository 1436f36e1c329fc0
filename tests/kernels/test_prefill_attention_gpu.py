"""kernels.prefill_attention against kernels.reference.paged_attention on the GPU.

Every case builds a paged cache with shuffled page ids in which every slot that
attention must not read (the rest of a sequence's last page, pages no sequence
owns, block-table entries past a sequence's pages) holds NaN, poisons the
output with NaN, and compares with the reference computed in float32 from the
same bf16 values by ||out - ref|| / ||ref||. The wrapper picks one of two
kernel shapes by grid size ("w32": 4 warps of 32 rows, "w16": 8 warps of 16
rows); most cases force each in turn. Head dim 256 has the w16 shape only.
"""

from __future__ import annotations

import pytest
import torch

from kernels.prefill_attention import _prefill_attention, paged_prefill_attention
from kernels.reference import paged_attention

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-2

VARIANTS = ["w32", "w16"]
# Head dim 256 (Qwen3-Next, Qwen3.5): forced w16 and the wrapper's own pick.
VARIANTS_256 = ["w16", None]

MIXED = [(1, 1), (17, 1), (33, 33), (40, 7), (16, 16), (5, 3), (64, 1), (23, 9),
         (300, 300), (1000, 129)]


class Batch:
    """A flat batch of (seq_len, q_len) sequences over a poisoned paged cache."""

    def __init__(
        self,
        pairs: list[tuple[int, int]],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        seed: int = 0,
        device: str = "cuda",
    ) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.pairs = pairs
        self.q_lens = [q_len for _, q_len in pairs]
        self.seq_lens = [seq_len for seq_len, _ in pairs]
        pages_needed = [-(-seq_len // page_size) for seq_len in self.seq_lens]
        num_pages = sum(pages_needed) + 3  # spare pages nobody owns
        max_pages = max(pages_needed, default=0) + 2  # table entries past every sequence
        order = torch.randperm(num_pages, generator=gen).tolist()
        owned, spare = order[:sum(pages_needed)], order[sum(pages_needed):]
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
        v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
        for page in spare:
            k_cache[page] = float("nan")
            v_cache[page] = float("nan")
        tables = torch.full((len(pairs), max_pages), spare[0], dtype=torch.int32)
        for b, seq_len in enumerate(self.seq_lens):
            for i in range(pages_needed[b]):
                tables[b, i] = owned.pop()
            if seq_len % page_size:
                last = int(tables[b, pages_needed[b] - 1])
                k_cache[last, seq_len % page_size:] = float("nan")
                v_cache[last, seq_len % page_size:] = float("nan")
        tokens = sum(self.q_lens)
        self.q = torch.randn((tokens, num_q_heads, head_dim), generator=gen).to(
            device=device, dtype=torch.bfloat16)
        self.k_cache = k_cache.to(device)
        self.v_cache = v_cache.to(device)
        self.block_tables = tables.to(device)
        starts = [0]
        for q_len in self.q_lens:
            starts.append(starts[-1] + q_len)
        self.starts = starts
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32, device=device)
        self.max_query_len = max(self.q_lens, default=0)
        self.scale = head_dim**-0.5

    def run(self, out: torch.Tensor | None = None, variant: str | None = None,
            **overrides) -> torch.Tensor:
        args = dict(
            q=self.q, k_cache=self.k_cache, v_cache=self.v_cache,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens_t,
            block_tables=self.block_tables, scale=self.scale,
            max_query_len=self.max_query_len, out=out,
        )
        args.update(overrides)
        if variant is None:
            return paged_prefill_attention(**args)
        return _prefill_attention(**args, variant=variant)

    def reference(self, scale: float | None = None) -> torch.Tensor:
        # float32 inputs (exact copies of the bf16 values) give a float32
        # result: no bf16 rounding of the reference output.
        return paged_attention(
            self.q.float(), self.k_cache.float(), self.v_cache.float(), self.starts,
            self.seq_lens, self.block_tables, self.scale if scale is None else scale,
        )


def check(batch: Batch, variant: str | None, max_query_len: int | None = None,
          scale: float | None = None) -> float:
    out = torch.full_like(batch.q, float("nan"))
    overrides: dict = {"variant": variant}
    if max_query_len is not None:
        overrides["max_query_len"] = max_query_len
    if scale is not None:
        overrides["scale"] = scale
    result = batch.run(out=out, **overrides)
    assert result is out
    torch.cuda.synchronize()
    ref = batch.reference(scale)
    assert not out.isnan().any(), (
        f"{int(out.isnan().sum())} NaN (unwritten or poisoned) of {out.numel()}; rows "
        f"{out.isnan().any(-1).any(-1).nonzero().flatten()[:16].tolist()}"
    )
    error = ((out.float() - ref).norm() / ref.norm()).item()
    if not error < TOLERANCE:
        # Name the worst sequence to make a failure readable.
        worst = max(
            range(len(batch.pairs)),
            key=lambda b: 0.0 if batch.q_lens[b] == 0 else (
                (out[batch.starts[b]:batch.starts[b + 1]].float()
                 - ref[batch.starts[b]:batch.starts[b + 1]]).norm()
                / ref[batch.starts[b]:batch.starts[b + 1]].norm()).item(),
        )
        pytest.fail(f"relative error {error:.3e}; worst sequence {worst} "
                    f"(seq_len, q_len) = {batch.pairs[worst]}")
    return error


def _heads_id(heads: tuple[int, int]) -> str:
    return f"{heads[0]}q{heads[1]}kv"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 4), (8, 2), (16, 2)], ids=_heads_id)
def test_mixed_batch(heads: tuple[int, int], head_dim: int, page_size: int, variant: str) -> None:
    # Decode rows, whole prompts, chunks over a prefix and a sequence with no
    # new token in one flat batch.
    pairs = [*MIXED[:5], (50, 0), *MIXED[5:]]
    seed = 7 * heads[0] + heads[1] + head_dim + page_size
    check(Batch(pairs, *heads, head_dim, page_size, seed=seed), variant)


@pytest.mark.parametrize("variant", VARIANTS_256)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [(16, 2), (4, 4), (6, 2), (32, 2)], ids=_heads_id)
def test_mixed_batch_head_dim_256(heads: tuple[int, int], page_size: int,
                                  variant: str | None) -> None:
    # 16q2kv: Qwen3-Next's and Qwen3.5's group of 8; 3 straddles warps.
    pairs = [*MIXED[:5], (50, 0), *MIXED[5:]]
    seed = 7 * heads[0] + heads[1] + 256 + page_size
    check(Batch(pairs, *heads, 256, page_size, seed=seed), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("heads", [(6, 2), (5, 1), (16, 1), (32, 8)], ids=_heads_id)
def test_mixed_batch_other_groups(heads: tuple[int, int], variant: str) -> None:
    # Groups of 3 and 5 do not divide the 128-row tile (a token's heads
    # straddle two warps or two blocks); 16 puts one or two tokens in a warp.
    check(Batch(MIXED, *heads, 128, 16, seed=7), variant)


@pytest.mark.parametrize("variant", [*VARIANTS, None])
@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 1024, 4096])
def test_whole_prompt(seq_len: int, variant: str | None) -> None:
    check(Batch([(seq_len, seq_len)], 32, 8, 128, 16, seed=seq_len), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seq_len", [17, 1024])
def test_whole_prompt_head_dim_64(seq_len: int, variant: str) -> None:
    check(Batch([(seq_len, seq_len)], 16, 2, 64, 64, seed=seq_len), variant)


@pytest.mark.parametrize("variant", VARIANTS_256)
@pytest.mark.parametrize("seq_len", [17, 1024, 4096])
def test_whole_prompt_head_dim_256(seq_len: int, variant: str | None) -> None:
    check(Batch([(seq_len, seq_len)], 16, 2, 256, 16, seed=seq_len), variant)


@pytest.mark.parametrize("variant", [*VARIANTS, None])
@pytest.mark.parametrize("seq_len", [8192, 32768])
def test_chunk_over_long_prefix(seq_len: int, variant: str | None) -> None:
    check(Batch([(seq_len, 512)], 32, 8, 128, 16, seed=3), variant)


@pytest.mark.parametrize("variant", VARIANTS_256)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("seq_len", [8192, 32768])
def test_chunk_over_long_prefix_head_dim_256(seq_len: int, page_size: int,
                                             variant: str | None) -> None:
    check(Batch([(seq_len, 512), (3000, 1)], 16, 2, 256, page_size, seed=3), variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunk_over_long_prefix_in_a_batch(variant: str) -> None:
    check(Batch([(8192, 512), (5000, 1), (700, 300)], 16, 4, 64, 64, seed=4), variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_only_batch(variant: str) -> None:
    check(Batch([(700, 1), (1, 1), (129, 1), (64, 1), (65, 1)], 32, 8, 128, 16, seed=5), variant)


@pytest.mark.parametrize(("head_dim", "variant"),
                         [(64, "w32"), (64, "w16"), (128, "w32"), (128, "w16"), (256, "w16")])
def test_sharp_softmax(head_dim: int, variant: str) -> None:
    # Large logits (std ~11 at D 128): the running max changes a lot between tiles.
    check(Batch([(2000, 700), (300, 300)], 8, 2, head_dim, 16, seed=6), variant, scale=1.0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loose_max_query_len(variant: str) -> None:
    # A max_query_len above the real one launches tiles that must exit cleanly.
    batch = Batch([(40, 7), (16, 16), (5, 3)], 8, 2, 128, 16, seed=8)
    check(batch, variant, max_query_len=sum(batch.q_lens))


@pytest.mark.parametrize(("head_dim", "variant"), [(128, "w32"), (128, "w16"), (256, "w16")])
def test_allocates_out_and_is_deterministic(head_dim: int, variant: str) -> None:
    batch = Batch(MIXED, 8, 2, head_dim, 16, seed=9)
    first = batch.run(variant=variant)
    second = batch.run(variant=variant)
    torch.cuda.synchronize()
    assert first.shape == batch.q.shape and first.dtype == torch.bfloat16
    assert torch.equal(first, second), "two runs differ: a race?"


def test_variants_agree() -> None:
    # Same math, different warp shapes: close, not bitwise (tile sizes differ).
    batch = Batch(MIXED, 32, 8, 128, 16, seed=11)
    w32 = batch.run(variant="w32").float()
    w16 = batch.run(variant="w16").float()
    assert ((w32 - w16).norm() / w16.norm()).item() < TOLERANCE


def test_head_dim_256_has_no_w32_shape() -> None:
    # 32 rows a warp would need 256 accumulator registers a thread for O alone.
    batch = Batch([(40, 7), (16, 16)], 16, 2, 256, 16, seed=12)
    with pytest.raises(ValueError, match="w32"):
        batch.run(variant="w32")


def test_empty_batch() -> None:
    batch = Batch([(10, 0), (3, 0)], 8, 2, 128, 16)
    out = batch.run()
    assert out.shape == (0, 8, 128)


def _bad_overrides(batch: Batch) -> dict[str, dict]:
    q, k, v = batch.q, batch.k_cache, batch.v_cache
    return {
        "q float32": dict(q=q.float()),
        "q on cpu": dict(q=q.cpu()),
        "q not contiguous": dict(q=q.transpose(0, 1).contiguous().transpose(0, 1)),
        "head dim 96": dict(q=q[..., :96].contiguous(), k_cache=k[..., :96].contiguous(),
                            v_cache=v[..., :96].contiguous()),
        "cache head dim": dict(k_cache=k[..., :64].contiguous(), v_cache=v[..., :64].contiguous()),
        "heads not a multiple": dict(q=q[:, :5].contiguous()),  # 5 query heads, 2 kv heads
        "v shape": dict(v_cache=v[:-1].contiguous()),
        "page size 24": dict(k_cache=torch.zeros_like(k[:, :12]).repeat(1, 2, 1, 1),
                             v_cache=torch.zeros_like(v[:, :12]).repeat(1, 2, 1, 1)),
        "k 3-d": dict(k_cache=k.flatten(0, 1)),
        "seq_lens int64": dict(seq_lens=batch.seq_lens_t.long()),
        "query_start_loc length": dict(query_start_loc=batch.query_start_loc[:-1].contiguous()),
        "block_tables rows": dict(block_tables=batch.block_tables[:-1].contiguous()),
        "block_tables int64": dict(block_tables=batch.block_tables.long()),
        "scale zero": dict(scale=0.0),
        "scale nan": dict(scale=float("nan")),
        "max_query_len float": dict(max_query_len=float(batch.max_query_len)),
        "max_query_len tensor": dict(max_query_len=torch.tensor(batch.max_query_len)),
        "max_query_len past T": dict(max_query_len=batch.q.shape[0] + 1),
        "max_query_len zero": dict(max_query_len=0),
        "out shape": dict(out=torch.empty_like(q)[:-1]),
        "out dtype": dict(out=torch.empty_like(q, dtype=torch.float16)),
        "q misaligned": dict(q=_misaligned(q)),
        "out misaligned": dict(out=_misaligned(q)),
    }


def _misaligned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of tensor whose data starts 2 bytes past a 16-byte boundary."""
    flat = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    view = flat[1:].view(tensor.shape)
    view.copy_(tensor)
    return view


BAD_CASES = [
    "q float32", "q on cpu", "q not contiguous", "head dim 96", "cache head dim",
    "heads not a multiple", "v shape", "page size 24", "k 3-d", "seq_lens int64", "query_start_loc length",
    "block_tables rows", "block_tables int64", "scale zero", "scale nan", "max_query_len float",
    "max_query_len tensor", "max_query_len past T", "max_query_len zero", "out shape",
    "out dtype", "q misaligned", "out misaligned",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs_raise(case: str) -> None:
    batch = Batch([(40, 7), (16, 16)], 8, 2, 128, 16, seed=10)
    overrides = _bad_overrides(batch)
    assert sorted(overrides) == sorted(BAD_CASES)
    with pytest.raises(ValueError):
        batch.run(**overrides[case])
