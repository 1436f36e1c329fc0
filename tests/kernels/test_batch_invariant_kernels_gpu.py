"""The kernels of batch-invariant mode (--deterministic) on the GPU.

skinny_linear_rows: any number of rows, cut into chunks of any size, gives
each row the bits it gets alone (its K split and reduction order depend on K
only), and stays within bf16 rounding of a float64 product.
paged_decode_attention with num_splits=1: a row's output is the same bits
alone, in any batch and under any max_seq_len bound, while the default split
rule does depend on the batch size (so the mode's fixed split is needed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.decode_attention import _num_splits, paged_decode_attention
from tests.kernels.test_decode_attention_gpu import assert_close, make_case, random_lens, reference
from tests.kernels.test_skinny_gemm_gpu import (
    QWEN3_0_6B,
    QWEN3_8B,
    assert_rows_close,
    random_weight,
    random_x,
)

pytestmark = pytest.mark.gpu

# Short K (one warp; two row groups at this N), odd N, K not a multiple of 128.
ODD = [(4352, 64), (1000, 1024), (9, 576), (33, 24), (2113, 136)]
ROWS = 150
CHUNKS = [1, 2, 3, 7, 8, 9, 16, 17, 63, 64, 65, 129, ROWS]


@pytest.mark.parametrize(("n", "k"), QWEN3_0_6B + QWEN3_8B + ODD)
def test_rows_in_chunks_of_any_size_are_the_one_row_bits(n: int, k: int) -> None:
    from kernels.skinny_gemm import skinny_linear_rows

    weight, bias = random_weight(n, k, seed=n + 7 * k)
    x = random_x(ROWS, k, seed=k)
    for b in (None, bias):
        alone = torch.cat([skinny_linear_rows(x[i:i + 1].clone(), weight, b)
                           for i in range(ROWS)])
        for chunk in CHUNKS:
            parts = [skinny_linear_rows(x[first:first + chunk], weight, b)
                     for first in range(0, ROWS, chunk)]
            assert torch.equal(torch.cat(parts), alone), f"chunks of {chunk}, bias {b is not None}"
        # Into a given output (as a graph would), and again (no races).
        out = torch.full((ROWS, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert skinny_linear_rows(x, weight, b, out=out) is out
        assert torch.equal(out, alone)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert_rows_close(out, exact, f"bias {b is not None}")


def test_the_k_split_depends_on_k_alone() -> None:
    from kernels.skinny_gemm import ROWS_MAX_WARPS, rows_k_split

    assert rows_k_split(1024) == (8, 8)
    assert rows_k_split(4096) == (8, 32)
    assert rows_k_split(64) == (1, 1)
    for k in (8, 136, 1000, 3072, 12288, 2**20):
        warps, steps = rows_k_split(k)
        assert 1 <= warps <= ROWS_MAX_WARPS and steps == -(-k // 128)
        # Evenly spread: no warp idle, none with more than one step extra.
        per_warp = -(-steps // warps)
        assert (warps - 1) * per_warp < steps


@pytest.mark.parametrize(("head_dim", "group"), [(128, 2), (128, 16), (64, 4), (256, 8)])
def test_one_split_gives_a_row_its_bits_in_any_batch(head_dim: int, group: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + group)
    lens = random_lens(40, 16, 3000, gen)
    case = make_case(lens, 2, group, head_dim, 16, seed=group, shared_pages=True)
    scale = head_dim**-0.5

    def attend(rows: slice, bound: int) -> torch.Tensor:
        return paged_decode_attention(case.q[rows].contiguous(), case.k_cache, case.v_cache,
                                      case.block_tables[rows].contiguous(),
                                      case.seq_lens[rows].contiguous(), scale, bound, None,
                                      num_splits=1)

    batch = attend(slice(None), 40960)
    for row, length in enumerate(lens):
        assert torch.equal(attend(slice(row, row + 1), length), batch[row:row + 1])
    assert torch.equal(torch.cat([attend(slice(first, first + 7), 4096)
                                  for first in range(0, 40, 7)]), batch)
    assert_close(batch, reference(case, scale))


def test_the_default_split_rule_depends_on_the_batch_and_the_bound() -> None:
    # Why the mode fixes one split: left to the rule, a row's chunks are dealt
    # to other numbers of CTAs (another summation order) as its batch changes.
    assert _num_splits(1, 8, 4096, 132) != _num_splits(64, 8, 4096, 132)
    assert _num_splits(4, 8, 4096, 132) != _num_splits(4, 8, 40960, 132)
