"""kernels.decode_attention against kernels.reference.paged_attention on the GPU.

Every case poisons the output with NaN first (every element must be written)
and fills each cache slot that a row does not own with NaN (reading past a
row's last token, or a block table entry past its last page, shows up as NaN).
The reference runs in float32 on the same bf16 cache, so the only rounding
left in the comparison is the kernel's own (bf16 probabilities and output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from kernels.decode_attention import decode_workspace, paged_decode_attention
from kernels.reference import paged_attention

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
# The engine's CUDA graphs pass the model's context limit, far above the rows.
GRAPH_MAX_SEQ_LEN = 40960
TOLERANCE = 1e-2


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    lens: list[int]


def random_lens(batch: int, page_size: int, max_len: int, gen: torch.Generator) -> list[int]:
    """Random lengths in 1..max_len; from the second row on, first the edges:
    one token, page boundaries, and the kernel's 64-token chunk boundary."""
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    if batch > 1:
        edges = [1, page_size, page_size + 1, 2 * page_size, 64, 65, max_len]
        lens[: len(edges)] = edges[:batch]
    return lens


def make_case(
    lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    page_size: int,
    *,
    seed: int,
    shared_pages: bool = False,
) -> Case:
    """Random bf16 q and caches. By default each row owns shuffled pages and
    every slot no row owns is NaN; with shared_pages, rows draw pages at random
    (with repeats) from a finite pool."""
    gen = torch.Generator().manual_seed(seed)
    cuda_gen = torch.Generator(device=DEVICE).manual_seed(seed)
    batch = len(lens)
    pages = [-(-n // page_size) for n in lens]
    width = max(pages) + 2
    if shared_pages:
        num_pages = max(4, sum(pages) // 3)
        block_tables = torch.randint(0, num_pages, (batch, width), generator=gen,
                                     dtype=torch.int32)
        owned = torch.ones(num_pages, page_size, dtype=torch.bool)
    else:
        num_pages = sum(pages) + 2
        order = torch.randperm(num_pages, generator=gen).tolist()
        # Entries past a row's pages point at a page of NaN.
        block_tables = torch.full((batch, width), order[-1], dtype=torch.int32)
        owned = torch.zeros(num_pages, page_size, dtype=torch.bool)
        start = 0
        for row, (n, count) in enumerate(zip(lens, pages, strict=True)):
            ids = order[start : start + count]
            start += count
            block_tables[row, :count] = torch.tensor(ids, dtype=torch.int32)
            owned[ids] = True
            owned[ids[-1], n - (count - 1) * page_size :] = False
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    nan_slots = ~owned.to(DEVICE)[:, :, None, None]
    caches = []
    for _ in range(2):
        cache = torch.randn(shape, generator=cuda_gen, device=DEVICE).to(torch.bfloat16)
        caches.append(cache.masked_fill_(nan_slots, math.nan))
    q = torch.randn((batch, num_kv_heads * group, head_dim), generator=cuda_gen, device=DEVICE)
    return Case(
        q=q.to(torch.bfloat16),
        k_cache=caches[0],
        v_cache=caches[1],
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        lens=lens,
    )


def reference(case: Case, scale: float) -> torch.Tensor:
    """float32 [B, Hq, D] reference (float32 q, so nothing is rounded to bf16)."""
    batch = len(case.lens)
    return paged_attention(case.q.float(), case.k_cache, case.v_cache, list(range(batch + 1)),
                           case.lens, case.block_tables[:batch], scale)


def run_kernel(case: Case, max_seq_len: int, max_batch: int | None = None) -> torch.Tensor:
    batch, num_heads, head_dim = case.q.shape
    workspace = decode_workspace(max_batch or batch, num_heads, head_dim, max_seq_len, DEVICE)
    out = torch.full_like(case.q, math.nan)
    result = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                    case.seq_lens, 1.0 / math.sqrt(head_dim), max_seq_len,
                                    workspace, out=out)
    assert result is out
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "unwritten (NaN) outputs or a read of a poisoned slot"
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error < TOLERANCE, f"relative error {error:.2e}"


CASES = [
    # batch, kv heads, group, head dim, page size
    (7, 4, 1, 128, 16),
    (7, 4, 2, 128, 16),
    (7, 2, 4, 128, 16),
    (7, 2, 8, 128, 16),
    (7, 1, 16, 128, 16),
    (7, 4, 1, 64, 64),
    (7, 4, 2, 64, 16),
    (7, 2, 4, 64, 64),
    (7, 2, 8, 64, 16),
    (7, 2, 16, 64, 64),
    (7, 2, 4, 128, 8),
    (7, 2, 2, 64, 32),
    (1, 8, 2, 128, 16),
    (1, 2, 8, 64, 64),
    (64, 8, 2, 128, 16),
    (64, 2, 4, 64, 64),
    (64, 4, 8, 128, 64),
    (256, 8, 2, 128, 16),
    (256, 2, 8, 64, 16),
    (256, 4, 4, 128, 64),
    # Head dim 256 (Qwen3-Next, Qwen3.5: 16 q heads on 2 kv heads). Groups
    # above 8 take two CTAs a split; 12 leaves the second one 4 heads.
    (7, 2, 8, 256, 16),
    (7, 2, 8, 256, 64),
    (7, 4, 1, 256, 64),
    (7, 2, 4, 256, 16),
    (7, 1, 16, 256, 16),
    (7, 2, 12, 256, 64),
    (1, 2, 8, 256, 64),
    (64, 2, 8, 256, 16),
    (64, 2, 16, 256, 64),
    (256, 2, 8, 256, 64),
]


@pytest.mark.parametrize(("batch", "num_kv_heads", "group", "head_dim", "page_size"), CASES)
def test_matches_reference(
    batch: int, num_kv_heads: int, group: int, head_dim: int, page_size: int
) -> None:
    seed = batch * 1000 + num_kv_heads * 100 + group * 10 + head_dim + page_size
    lens = random_lens(batch, page_size, 2000, torch.Generator().manual_seed(seed))
    case = make_case(lens, num_kv_heads, group, head_dim, page_size, seed=seed)
    ref = reference(case, 1.0 / math.sqrt(head_dim))
    # The tight bound and the graph's huge one split the work differently;
    # both must give the reference.
    assert_close(run_kernel(case, max(lens)), ref)
    assert_close(run_kernel(case, GRAPH_MAX_SEQ_LEN), ref)


def test_shared_pages() -> None:
    gen = torch.Generator().manual_seed(5)
    lens = random_lens(64, 16, 2000, gen)
    case = make_case(lens, 2, 4, 128, 16, seed=5, shared_pages=True)
    ref = reference(case, 1.0 / math.sqrt(128))
    assert_close(run_kernel(case, max(lens)), ref)
    assert_close(run_kernel(case, GRAPH_MAX_SEQ_LEN), ref)


def test_single_token_rows() -> None:
    case = make_case([1] * 7, 2, 4, 128, 16, seed=6)
    ref = reference(case, 1.0 / math.sqrt(128))
    assert_close(run_kernel(case, 1), ref)
    assert_close(run_kernel(case, GRAPH_MAX_SEQ_LEN), ref)


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "page_size"),
                         [(8, 4, 128, 16), (2, 8, 256, 16), (2, 8, 256, 64), (2, 16, 256, 64)])
def test_long_context(num_kv_heads: int, group: int, head_dim: int, page_size: int) -> None:
    # Many splits of many chunks each (and, at 32001, a ragged last chunk).
    case = make_case([32768, 32001], num_kv_heads, group, head_dim, page_size, seed=7)
    ref = reference(case, 1.0 / math.sqrt(head_dim))
    assert_close(run_kernel(case, 32768), ref)
    assert_close(run_kernel(case, GRAPH_MAX_SEQ_LEN), ref)


def test_smaller_batch_than_workspace_and_tables() -> None:
    """Only the first B rows of block_tables and seq_lens are read."""
    lens = [300, 17, 1000]
    case = make_case([*lens, 5000], 2, 8, 128, 16, seed=8)
    ref = reference(Case(case.q[:3].contiguous(), case.k_cache, case.v_cache,
                         case.block_tables, case.seq_lens, lens), 1.0 / math.sqrt(128))
    workspace = decode_workspace(16, 16, 128, 2000, DEVICE)
    out = paged_decode_attention(case.q[:3].contiguous(), case.k_cache, case.v_cache,
                                 case.block_tables, case.seq_lens, 1.0 / math.sqrt(128), 1000,
                                 workspace)
    assert_close(out, ref)


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(8, 2, 128), (2, 16, 256)])
@pytest.mark.parametrize(("batch", "max_len"), [(8, 2000), (512, 300)])
def test_cuda_graph_replay(batch: int, max_len: int, num_kv_heads: int, group: int,
                           head_dim: int) -> None:
    """Capture once with static tensors; new q, lengths and page tables replay right.
    batch 8 runs split-K (two kernels), batch 512 a single kernel."""
    page_size = 16
    num_heads = num_kv_heads * group
    scale = 1.0 / math.sqrt(head_dim)
    gen = torch.Generator().manual_seed(9)
    cuda_gen = torch.Generator(device=DEVICE).manual_seed(9)
    pages_per_row = -(-max_len // page_size)
    num_pages = batch * pages_per_row + 1
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=cuda_gen, device=DEVICE).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=cuda_gen, device=DEVICE).to(torch.bfloat16)
    width = GRAPH_MAX_SEQ_LEN // page_size
    q = torch.randn((batch, num_heads, head_dim), device=DEVICE).to(torch.bfloat16)
    block_tables = torch.zeros((batch, width), dtype=torch.int32, device=DEVICE)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    workspace = decode_workspace(batch, num_heads, head_dim, GRAPH_MAX_SEQ_LEN, DEVICE)

    def step() -> None:
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                               GRAPH_MAX_SEQ_LEN, workspace, out=out)

    step()  # compiles and loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for trial in range(3):
        lens = random_lens(batch, page_size, max_len, gen)
        if trial == 2:
            lens[batch // 2 :] = [1] * (batch - batch // 2)  # padded rows: one token, page 0
        order = torch.randperm(num_pages - 1, generator=gen) + 1
        tables = torch.zeros((batch, width), dtype=torch.int32)
        tables[:, :pages_per_row] = order[: batch * pages_per_row].view(batch, pages_per_row)
        if trial == 2:
            tables[batch // 2 :] = 0
        q.copy_(torch.randn((batch, num_heads, head_dim), generator=cuda_gen, device=DEVICE))
        block_tables.copy_(tables)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        case = Case(q, k_cache, v_cache, block_tables, seq_lens, lens)
        assert_close(out, reference(case, scale))


def test_allocates_out_when_not_given() -> None:
    case = make_case([40, 3], 2, 2, 64, 16, seed=10)
    workspace = decode_workspace(2, 4, 64, 64, DEVICE)
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                 case.seq_lens, 0.125, 64, workspace)
    assert out.dtype == torch.bfloat16 and out.shape == case.q.shape
    assert_close(out, reference(case, 0.125))


def test_bad_inputs_raise() -> None:
    case = make_case([40, 3], 2, 2, 128, 16, seed=11)
    workspace = decode_workspace(2, 4, 128, 64, DEVICE)
    good = {
        "q": case.q, "k_cache": case.k_cache, "v_cache": case.v_cache,
        "block_tables": case.block_tables, "seq_lens": case.seq_lens, "scale": 0.1,
        "max_seq_len": 64, "workspace": workspace,
    }
    batch, num_heads, _ = case.q.shape
    bad = {
        "q dtype": {"q": case.q.float()},
        "q not contiguous": {"q": case.q.transpose(1, 2).contiguous().transpose(1, 2)},
        "q on the cpu": {"q": case.q.cpu()},
        "k dtype": {"k_cache": case.k_cache.half()},
        "v shape": {"v_cache": case.v_cache[:-1].contiguous()},
        "heads not a multiple": {"q": case.q[:, :3].contiguous()},
        "unsupported head dim": {
            "q": case.q[:, :, :96].contiguous(),
            "k_cache": case.k_cache[..., :96].contiguous(),
            "v_cache": case.v_cache[..., :96].contiguous(),
        },
        "block table dtype": {"block_tables": case.block_tables.long()},
        "seq_lens dtype": {"seq_lens": case.seq_lens.long()},
        "seq_lens too short": {"seq_lens": case.seq_lens[:1].contiguous()},
        "batch over workspace": {
            "q": torch.cat([case.q] * 2),
            "block_tables": torch.cat([case.block_tables] * 2),
            "seq_lens": torch.cat([case.seq_lens] * 2),
        },
        "max_seq_len over workspace": {"max_seq_len": 65},
        "tensor scale": {"scale": torch.tensor(0.1)},
        "out shape": {"out": torch.empty((batch, num_heads, 64), dtype=torch.bfloat16,
                                         device=DEVICE)},
    }
    for what, change in bad.items():
        with pytest.raises(ValueError):
            paged_decode_attention(**{**good, **change})
            pytest.fail(f"no ValueError for {what}")
    with pytest.raises(ValueError):
        decode_workspace(2, 4, 96, 64, DEVICE)
    with pytest.raises(ValueError):
        decode_workspace(2, 4, 128, 64, torch.device("cpu"))
