"""kernels.gated_delta_tc (the chunked gated delta rule on tensor cores) against
the torch reference, and CudaOps' choice of it.

The reference runs on the GPU in float32 with TF32 off, on the same bf16
inputs; the kernel computes the same chunked form with 3xTF32 products
(float32 accuracy) in another summation order and rounds outputs to bf16
once: outputs within a bf16 rounding step (rtol / atol 2e-2, as the
recurrent kernel's tests allow), float32 states within float32 summation
order over thousands of tokens (1e-3).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from kernels import gated_delta_reference as ref
from kernels import gated_delta_tc
from kernels.gated_delta import gated_delta_rule as recurrent_rule
from kernels.gated_delta_tc import gated_delta_rule_tc

pytestmark = pytest.mark.gpu

OUT_TOL = {"rtol": 2e-2, "atol": 2e-2}
STATE_TOL = {"rtol": 1e-3, "atol": 1e-3}
QWEN35 = (16, 32, 128, 128)  # (Hk, Hv, Dk, Dv) of Qwen3.5's linear attention
# Small odd ones: 3 value heads per key head; Dv 96 (three column blocks).
ODD_SHAPES = [(1, 3, 128, 32), (2, 4, 128, 96)]
SLOTS = 8


@pytest.fixture(autouse=True)
def ieee_reference_matmuls() -> Iterator[None]:
    """The reference's float32 matmuls in full precision (no TF32)."""
    matmul = torch.backends.cuda.matmul
    # fp32_precision is torch >= 2.9's switch; allow_tf32 the older one.
    flag, ieee = (("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision")
                  else ("allow_tf32", False))
    before = getattr(matmul, flag)
    setattr(matmul, flag, ieee)
    try:
        yield
    finally:
        setattr(matmul, flag, before)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _batch(work: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, ...]:
    """(query_start_loc int32, slots int64, fresh bool) on the GPU, and the host bounds."""
    starts = [0]
    for tokens, _, _ in work:
        starts.append(starts[-1] + tokens)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    slots = torch.tensor([s for _, s, _ in work], dtype=torch.int64, device="cuda")
    fresh = torch.tensor([f for _, _, f in work], dtype=torch.bool, device="cuda")
    return qsl, slots, fresh, tuple(starts)


def _case(tokens: int, seed: int, shape: tuple[int, ...] = QWEN35) -> dict[str, torch.Tensor]:
    """bf16 operands as the layer passes them (q, k, v strided views of the
    conv output; a, b columns of one projection) and a state pool."""
    hk, hv, dk, dv = shape
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, device="cuda",
                        generator=_gen(seed)).to(torch.bfloat16)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    ab = torch.randn(tokens, 2 * hv, device="cuda", generator=_gen(seed + 1)).to(torch.bfloat16)
    # Decays as the models learn them: A = 1..16, dt_bias around 0.
    a_log = torch.empty(hv, device="cuda").uniform_(0.0, math.log(16.0), generator=_gen(seed + 2))
    dt_bias = torch.randn(hv, device="cuda", generator=_gen(seed + 3)) * 0.5
    states = torch.randn(SLOTS, hv, dk, dv, device="cuda", generator=_gen(seed + 4)) * 0.1
    return {"q": q.view(tokens, hk, dk), "k": k.view(tokens, hk, dk),
            "v": v.view(tokens, hv, dv), "a": ab[:, :hv], "b": ab[:, hv:],
            "a_log": a_log.to(torch.bfloat16), "dt_bias": dt_bias.to(torch.bfloat16),
            "states": states}


def _operands(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"], x["dt_bias"]


def _reference(x: dict[str, torch.Tensor], states: torch.Tensor, slots: torch.Tensor,
               fresh: torch.Tensor, qsl_host: tuple[int, ...]) -> torch.Tensor:
    g, beta = ref.gdn_gating(x["a"], x["b"], x["a_log"], x["dt_bias"])
    return ref.gated_delta_rule(x["q"], x["k"], x["v"], g, beta, states, slots, fresh, qsl_host)


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 200, 1000, 5000])
def test_one_sequence_matches_the_reference(tokens: int, fresh: bool) -> None:
    x = _case(tokens, seed=tokens + fresh)
    qsl, slots, fresh_flags, qsl_host = _batch([(tokens, 5, fresh)])
    expected_states = x["states"].clone()
    expected = _reference(x, expected_states, slots, fresh_flags, qsl_host)
    out = torch.full(x["v"].shape, math.nan, dtype=torch.bfloat16, device="cuda")
    got = gated_delta_rule_tc(*_operands(x), x["states"], slots, fresh_flags, qsl, out=out)
    torch.cuda.synchronize()
    assert got is out
    torch.testing.assert_close(got, expected, **OUT_TOL)
    torch.testing.assert_close(x["states"], expected_states, **STATE_TOL)


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("tokens", [1, 65, 200])
def test_odd_shapes_match_the_reference(shape: tuple[int, ...], tokens: int) -> None:
    x = _case(tokens, seed=7, shape=shape)
    qsl, slots, fresh, qsl_host = _batch([(tokens, 2, False)])
    expected_states = x["states"].clone()
    expected = _reference(x, expected_states, slots, fresh, qsl_host)
    got = gated_delta_rule_tc(*_operands(x), x["states"], slots, fresh, qsl)
    torch.testing.assert_close(got, expected, **OUT_TOL)
    torch.testing.assert_close(x["states"], expected_states, **STATE_TOL)


# (tokens, slot, fresh): slots out of order, a sequence with no tokens (slot
# 4), one with no slot (-1), fresh and continuing, chunk-aligned and not.
MIXED = [(130, 6, False), (1, 3, True), (0, 4, False), (64, 0, True), (17, -1, False),
         (700, 2, False), (5, 7, False)]


def test_a_batch_of_sequences_matches_the_reference() -> None:
    tokens = sum(t for t, _, _ in MIXED)
    x = _case(tokens, seed=11)
    qsl, slots, fresh, qsl_host = _batch(MIXED)
    before = x["states"].clone()
    # The reference knows no slot -1: it runs the others, and that row stays unwritten.
    kept = [i for i, (_, slot, _) in enumerate(MIXED) if slot >= 0]
    expected_states = x["states"].clone()
    expected = torch.full(x["v"].shape, math.nan, dtype=torch.bfloat16, device="cuda")
    for i in kept:
        rows = slice(qsl_host[i], qsl_host[i + 1])
        part = {name: (t[rows] if name not in ("a_log", "dt_bias", "states") else t)
                for name, t in x.items()}
        expected[rows] = _reference(part, expected_states, slots[i:i + 1], fresh[i:i + 1],
                                    (0, rows.stop - rows.start))
    out = torch.full(x["v"].shape, math.nan, dtype=torch.bfloat16, device="cuda")
    gated_delta_rule_tc(*_operands(x), x["states"], slots, fresh, qsl, out=out)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, equal_nan=True, **OUT_TOL)
    torch.testing.assert_close(x["states"], expected_states, **STATE_TOL)
    # The empty sequence's slot and the slots in no batch are left as they were.
    assert torch.equal(x["states"][[1, 4, 5]], before[[1, 4, 5]])


def test_min_tokens_leaves_short_sequences_alone() -> None:
    work = [(3, 1, False), (80, 0, True), (1, 2, False)]
    x = _case(sum(t for t, _, _ in work), seed=13)
    qsl, slots, fresh, _ = _batch(work)
    before = x["states"].clone()
    out = torch.full(x["v"].shape, math.nan, dtype=torch.bfloat16, device="cuda")
    gated_delta_rule_tc(*_operands(x), x["states"], slots, fresh, qsl, out=out, min_tokens=16)
    torch.cuda.synchronize()
    assert out[:3].isnan().all() and out[83:].isnan().all() and not out[3:83].isnan().any()
    assert torch.equal(x["states"][[1, 2]], before[[1, 2]])
    assert not torch.equal(x["states"][0], before[0])


def test_a_prompt_in_two_steps_equals_one_pass() -> None:
    tokens, split = 1000, 333
    x = _case(tokens, seed=17)
    qsl, slots, fresh, _ = _batch([(tokens, 3, True)])
    one_pass = gated_delta_rule_tc(*_operands(x), x["states"], slots, fresh, qsl).clone()
    final = x["states"][3].clone()
    outs = []
    for start, end in ((0, split), (split, tokens)):
        piece = {name: (t[start:end] if name not in ("a_log", "dt_bias", "states") else t)
                 for name, t in x.items()}
        pqsl, pslots, pfresh, _ = _batch([(end - start, 3, start == 0)])
        outs.append(gated_delta_rule_tc(*_operands(piece), x["states"], pslots, pfresh, pqsl))
    torch.testing.assert_close(torch.cat(outs), one_pass, **OUT_TOL)
    torch.testing.assert_close(x["states"][3], final, **STATE_TOL)


def test_replays_in_a_cuda_graph_as_it_runs_eagerly() -> None:
    """Capture once, replay with other lengths, slots and fresh flags in the
    same buffers: bit for bit what an eager launch computes."""
    first = [(100, 3, False), (0, 0, True), (28, 5, True), (1, 1, False)]
    second = [(64, 2, True), (60, 6, False), (0, 4, False), (5, 7, False)]
    tokens = sum(t for t, _, _ in first)
    assert tokens == sum(t for t, _, _ in second)
    x = _case(tokens, seed=19)
    pool = x["states"].clone()
    qsl, slots, fresh, _ = _batch(first)
    out = torch.empty(x["v"].shape, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        gated_delta_rule_tc(*_operands(x), x["states"], slots, fresh, qsl, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and loads the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for work, seed in ((first, 20), (second, 30)):
        new = _case(tokens, seed=seed)
        for name in ("q", "k", "v", "a", "b"):
            x[name].copy_(new[name])
        new_qsl, new_slots, new_fresh, _ = _batch(work)
        qsl.copy_(new_qsl)
        slots.copy_(new_slots)
        fresh.copy_(new_fresh)
        x["states"].copy_(pool)
        out.fill_(math.nan)
        graph.replay()
        replayed = (out.clone(), x["states"].clone())
        x["states"].copy_(pool)
        out.fill_(math.nan)
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed[0].nan_to_num(7.0), out.nan_to_num(7.0))
        assert torch.equal(replayed[1], x["states"])


def _meta(work: list[tuple[int, int, bool]], *, graph: bool = False,
          max_query_len: int | None = None):  # type: ignore[no-untyped-def]
    from engine.execution.attention_metadata import AttentionMetadata

    qsl, slots, fresh, qsl_host = _batch(work)
    empty = torch.zeros(0, dtype=torch.int32, device="cuda")
    return AttentionMetadata(
        query_start_loc=qsl, seq_lens=empty, block_tables=empty, slot_mapping=empty.long(),
        max_query_len=max(t for t, _, _ in work) if max_query_len is None else max_query_len,
        max_seq_len=0, query_start_loc_host=() if graph else qsl_host, seq_lens_host=(),
        state_slots=slots, state_fresh=fresh)


@pytest.fixture
def ops_and_calls(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """CudaOps, and the number of times it launched the tensor-core kernel."""
    from engine.execution.model_ops import CudaOps
    from engine.models import ModelConfig
    from tests.perf.gpu_models import hf_config

    calls: list[int] = []
    kernel = gated_delta_tc.gated_delta_rule_tc

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs["min_tokens"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(gated_delta_tc, "gated_delta_rule_tc", spy)
    ops = CudaOps(ModelConfig.from_hf_config(hf_config("qwen3-0.6b")), torch.device("cuda"),
                  decode_batch=4, max_seq_len=16)
    return ops, calls


@pytest.mark.parametrize("graph", [False, True])
def test_cuda_ops_run_prompt_steps_on_the_tensor_core_kernel(ops_and_calls, graph: bool) -> None:  # type: ignore[no-untyped-def]
    """A prompt step runs its long sequences on the tensor-core kernel and
    its short ones (decode rows, a few-token chunk) on the recurrent kernel,
    bit for bit as that kernel alone; with host bounds or without (a graph
    step) the same numbers."""
    ops, calls = ops_and_calls
    least = gated_delta_tc.MIN_TC_TOKENS
    work = [(1, 3, False), (least + 300, 0, True), (least - 1, 6, False), (least, 1, False),
            (1, 2, True), (0, 4, False)]
    x = _case(sum(t for t, _, _ in work), seed=23)
    meta = _meta(work, graph=graph)
    states = x["states"]
    initial, reference_states, recurrent_states = states.clone(), states.clone(), states.clone()
    expected = _reference(x, reference_states, meta.state_slots, meta.state_fresh,
                          _meta(work).query_start_loc_host)
    recurrent = recurrent_rule(*_operands(x), recurrent_states, meta.state_slots,
                               meta.state_fresh, meta.query_start_loc)
    got = ops.gated_delta_rule(*_operands(x), states, meta)
    torch.cuda.synchronize()
    assert calls == [least]
    torch.testing.assert_close(got, expected, **OUT_TOL)
    torch.testing.assert_close(states, reference_states, **STATE_TOL)
    bounds = _meta(work).query_start_loc_host
    for i in (0, 2, 4):  # the short sequences: the recurrent kernel's numbers
        rows = slice(bounds[i], bounds[i + 1])
        assert torch.equal(got[rows], recurrent[rows])
        slot = work[i][1]
        assert torch.equal(states[slot], recurrent_states[slot])
    if not graph:
        # The same step as a graph would run it (no host bounds): bit for bit.
        again = initial.clone()
        replayed = ops.gated_delta_rule(*_operands(x), again, _meta(work, graph=True))
        assert torch.equal(replayed, got) and torch.equal(again, states)


@pytest.mark.parametrize("graph", [False, True])
def test_cuda_ops_keep_decode_and_verify_steps_recurrent(ops_and_calls, graph: bool) -> None:  # type: ignore[no-untyped-def]
    """Decode steps, and verify steps (drafts laid out as decode rows,
    max_query_len 1, each sequence's tokens together for the state), run
    the recurrent kernel alone: bit for bit."""
    ops, calls = ops_and_calls
    work = ([(1, slot, slot == 2) for slot in (5, 2, 7, 0)] if graph
            else [(4, 5, False), (1, 2, False), (3, 0, False)])
    x = _case(sum(t for t, _, _ in work), seed=29)
    meta = _meta(work, graph=graph, max_query_len=1)
    expected_states = x["states"].clone()
    expected = recurrent_rule(*_operands(x), expected_states, meta.state_slots,
                              meta.state_fresh, meta.query_start_loc)
    got = ops.gated_delta_rule(*_operands(x), x["states"], meta)
    assert calls == []
    assert torch.equal(got, expected) and torch.equal(x["states"], expected_states)


def test_cuda_ops_keep_key_dims_not_built_off_the_tensor_core_kernel(ops_and_calls) -> None:  # type: ignore[no-untyped-def]
    ops, calls = ops_and_calls
    work = [(90, 1, True), (1, 0, False)]
    x = _case(91, seed=31, shape=(2, 4, 64, 64))
    meta = _meta(work)
    expected_states = x["states"].clone()
    expected = recurrent_rule(*_operands(x), expected_states, meta.state_slots,
                              meta.state_fresh, meta.query_start_loc)
    got = ops.gated_delta_rule(*_operands(x), x["states"], meta)
    assert calls == []
    assert torch.equal(got, expected) and torch.equal(x["states"], expected_states)


@pytest.mark.parametrize("tokens", [16, 59, 60, 63, 100, 1000])
def test_the_same_inputs_give_the_same_bits(tokens: int) -> None:
    """Deterministic: run twice (with another batch in between, which leaves
    other values in shared memory and registers) -> identical outputs and
    states. Plain decoding and speculative decoding must prefill a prompt
    the same way, bit for bit."""
    x = _case(tokens, seed=tokens * 7)
    qsl, slots, fresh, _ = _batch([(tokens, 2, True)])
    start_states = x["states"].clone()
    first = gated_delta_rule_tc(*_operands(x), x["states"], slots, fresh, qsl).clone()
    first_states = x["states"].clone()
    other = _case(777, seed=5)
    oqsl, oslots, ofresh, _ = _batch([(777, 2, False)])
    gated_delta_rule_tc(*_operands(other), other["states"], oslots, ofresh, oqsl)
    x["states"].copy_(start_states)
    second = gated_delta_rule_tc(*_operands(x), x["states"], slots, fresh, qsl)
    torch.cuda.synchronize()
    assert torch.equal(first, second)
    assert torch.equal(first_states, x["states"])
