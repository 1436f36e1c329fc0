"""kernels.gated_delta_chunked on the GPU against the recurrent CUDA kernel,
and CudaOps' choice between them.

Both compute the same float32 recurrence from the same bf16 inputs (the
chunked form as matrix products with TF32 off) and round outputs to bf16
once, so outputs differ by at most about a bf16 rounding step (rtol / atol
2e-2, as the kernel's own tests allow against the reference) and float32
states by float32 summation order over thousands of tokens (1e-3).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import gated_delta_chunked
from kernels.gated_delta import gated_delta_rule
from kernels.gated_delta_chunked import gated_delta_rule_chunked

pytestmark = pytest.mark.gpu

OUT_TOL = {"rtol": 2e-2, "atol": 2e-2}
STATE_TOL = {"rtol": 1e-3, "atol": 1e-3}
QWEN35 = (16, 32, 128, 128)  # (Hk, Hv, Dk, Dv) of Qwen3.5-35B-A3B's linear attention
# Key head size 128 goes to the tensor-core kernel in prompt steps
# (kernels/gated_delta_tc.py); the torch chunked form serves the other built
# sizes: the dispatch tests use one.
OTHER_DK = (2, 4, 256, 64)
SLOTS = 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _batch(work: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, ...]:
    starts = [0]
    for tokens, _, _ in work:
        starts.append(starts[-1] + tokens)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    slots = torch.tensor([s for _, s, _ in work], dtype=torch.int64, device="cuda")
    fresh = torch.tensor([f for _, _, f in work], dtype=torch.bool, device="cuda")
    return qsl, slots, fresh, tuple(starts)


def _case(tokens: int, seed: int, shape: tuple[int, ...] = QWEN35) -> dict[str, torch.Tensor]:
    """bf16 operands as the layer passes them: q, k, v strided views of the
    conv output, a and b columns of one projection."""
    hk, hv, dk, dv = shape
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, device="cuda",
                        generator=_gen(seed)).to(torch.bfloat16)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    ab = torch.randn(tokens, 2 * hv, device="cuda", generator=_gen(seed + 1)).to(torch.bfloat16)
    a_log = torch.empty(hv, device="cuda").uniform_(0.0, math.log(16.0), generator=_gen(seed + 2))
    dt_bias = torch.randn(hv, device="cuda", generator=_gen(seed + 3)) * 0.5
    return {"q": q.view(tokens, hk, dk), "k": k.view(tokens, hk, dk),
            "v": v.view(tokens, hv, dv), "a": ab[:, :hv], "b": ab[:, hv:],
            "a_log": a_log.to(torch.bfloat16), "dt_bias": dt_bias.to(torch.bfloat16)}


def _pool(seed: int, shape: tuple[int, ...] = QWEN35) -> torch.Tensor:
    _, hv, dk, dv = shape
    return torch.randn(SLOTS, hv, dk, dv, device="cuda", generator=_gen(seed)) * 0.1


def _operands(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"], x["dt_bias"]


# 5000 tokens span two windows (WINDOW_TOKENS 4096).
@pytest.mark.parametrize(("tokens", "fresh"), [(300, True), (1000, False), (5000, False)])
def test_chunked_matches_the_recurrent_kernel(tokens: int, fresh: bool) -> None:
    x = _case(tokens, seed=tokens)
    qsl, slots, fresh_flags, qsl_host = _batch([(tokens, 5, fresh)])
    states, expected_states = _pool(1), _pool(1)
    expected = gated_delta_rule(*_operands(x), expected_states, slots, fresh_flags, qsl)
    got = gated_delta_rule_chunked(*_operands(x), states, slots, fresh_flags, qsl_host)
    torch.cuda.synchronize()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, **OUT_TOL)
    torch.testing.assert_close(states, expected_states, **STATE_TOL)


def _meta(work: list[tuple[int, int, bool]], *, graph: bool = False):  # type: ignore[no-untyped-def]
    from engine.execution.attention_metadata import AttentionMetadata

    qsl, slots, fresh, qsl_host = _batch(work)
    empty = torch.zeros(0, dtype=torch.int32, device="cuda")
    return AttentionMetadata(
        query_start_loc=qsl, seq_lens=empty, block_tables=empty, slot_mapping=empty.long(),
        max_query_len=max(t for t, _, _ in work), max_seq_len=0,
        query_start_loc_host=() if graph else qsl_host, seq_lens_host=(),
        state_slots=slots, state_fresh=fresh)


@pytest.fixture
def ops_and_calls(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """CudaOps, and the sequence lists it hands the chunked form."""
    from engine.execution.model_ops import CudaOps
    from engine.models import ModelConfig
    from tests.perf.gpu_models import hf_config

    calls: list[list[int]] = []
    chunked = gated_delta_chunked.gated_delta_rule_chunked

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(list(kwargs["sequences"]))
        return chunked(*args, **kwargs)

    monkeypatch.setattr(gated_delta_chunked, "gated_delta_rule_chunked", spy)
    ops = CudaOps(ModelConfig.from_hf_config(hf_config("qwen3-0.6b")), torch.device("cuda"),
                  decode_batch=4, max_seq_len=16)
    return ops, calls


def test_cuda_ops_run_long_prompts_chunked_and_the_rest_recurrent(ops_and_calls) -> None:  # type: ignore[no-untyped-def]
    ops, calls = ops_and_calls
    least = gated_delta_chunked.MIN_CHUNKED_TOKENS
    # A decode row, a long fresh prompt, a short prompt, a long continuing
    # prompt, a fresh decode row; slots out of order.
    work = [(1, 3, False), (least + 344, 0, True), (40, 6, False), (least, 1, False),
            (1, 2, True)]
    x = _case(sum(t for t, _, _ in work), seed=3, shape=OTHER_DK)
    meta = _meta(work)
    states, expected_states = _pool(2, OTHER_DK), _pool(2, OTHER_DK)
    expected = gated_delta_rule(*_operands(x), expected_states, meta.state_slots,
                                meta.state_fresh, meta.query_start_loc)
    got = ops.gated_delta_rule(*_operands(x), states, meta)
    torch.cuda.synchronize()
    assert calls == [[1, 3]]
    torch.testing.assert_close(got, expected, **OUT_TOL)
    torch.testing.assert_close(states, expected_states, **STATE_TOL)


@pytest.mark.parametrize("graph", [False, True])
def test_cuda_ops_keep_decode_and_graph_steps_recurrent(ops_and_calls, graph: bool) -> None:  # type: ignore[no-untyped-def]
    """Decode steps, and any step inside a CUDA graph (no host bounds, even
    with a long prompt in it), run the recurrent kernel alone: bit for bit."""
    ops, calls = ops_and_calls
    work = ([(1, 4, False), (gated_delta_chunked.MIN_CHUNKED_TOKENS * 2, 0, True)] if graph
            else [(1, slot, slot == 2) for slot in (5, 2, 7, 0)])
    x = _case(sum(t for t, _, _ in work), seed=4, shape=OTHER_DK)
    meta = _meta(work, graph=graph)
    states, expected_states = _pool(3, OTHER_DK), _pool(3, OTHER_DK)
    expected = gated_delta_rule(*_operands(x), expected_states, meta.state_slots,
                                meta.state_fresh, meta.query_start_loc)
    got = ops.gated_delta_rule(*_operands(x), states, meta)
    assert calls == []
    assert torch.equal(got, expected) and torch.equal(states, expected_states)
