"""kernels.gated_delta (Gated DeltaNet conv and delta rule) against the torch reference.

The references run on the CPU (float32 math, no TF32 anywhere) on copies of
the same bf16 inputs; the kernels compute in float32 too and round outputs
to bf16 once, so outputs differ only where a float32 sum in another order
lands on the other side of a bf16 rounding boundary: one bf16 ulp (2^-8
relative), hence rtol 1e-2 for the conv (K products) and 2e-2 / atol 2e-2
for the delta rule, whose prompts the reference runs in the chunked form
(triangular solve, exp of cumulative decays: other float32 roundings of
the same recurrence). The float32 states carry those differences only:
rtol / atol 1e-4. The conv states are copies of bf16 inputs: exactly equal.

Batches mix decode rows, prefill chunks, fresh and continuing sequences, a
sequence with no tokens, slots out of order and unused slots (which must be
left as they were), and operands that are strided views of a wider
projection, as the model passes them.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import gated_delta_reference as ref

pytestmark = pytest.mark.gpu

# (tokens, slot, fresh) per sequence: decode rows, chunks shorter than K-1
# that continue (their new conv state keeps older inputs), a sequence with
# no tokens, a long prompt spanning several 64-token chunks of the reference.
MIXED = [(1, 7, False), (137, 2, True), (0, 4, False), (1, 0, False), (2, 5, False),
         (70, 1, False), (5, 3, True), (1, 6, True)]
NUM_SLOTS = 9  # slot 8 is in no batch
CONV_TOL = {"rtol": 1e-2, "atol": 1e-2}
OUT_TOL = {"rtol": 2e-2, "atol": 2e-2}
STATE_TOL = {"rtol": 1e-4, "atol": 1e-4}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _batch(work: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, ...]:
    """(query_start_loc int32, slots int64, fresh bool) on the GPU, and the host tuple."""
    starts = [0]
    for tokens, _, _ in work:
        starts.append(starts[-1] + tokens)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    slots = torch.tensor([s for _, s, _ in work], dtype=torch.int64, device="cuda")
    fresh = torch.tensor([f for _, _, f in work], dtype=torch.bool, device="cuda")
    return qsl, slots, fresh, tuple(starts)


def _strided(tokens: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """bf16 [T, width], a column slice of a wider tensor (rows strided)."""
    wide = torch.randn(tokens, width + 24, device="cuda", generator=_gen(seed)) * scale
    return wide.to(torch.bfloat16)[:, 8:8 + width]


def _conv_case(channels: int, width: int, with_bias: bool,
               work: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, ...]:
    tokens = sum(t for t, _, _ in work)
    x = _strided(tokens, channels, seed=channels + width)
    weight = (torch.randn(channels, width, device="cuda", generator=_gen(1)) * 0.5).to(
        torch.bfloat16)
    bias = (torch.randn(channels, device="cuda", generator=_gen(2)).to(torch.bfloat16)
            if with_bias else None)
    conv_states = torch.randn(NUM_SLOTS, channels, width - 1, device="cuda",
                              generator=_gen(3)).to(torch.bfloat16)
    return x, weight, bias, conv_states


@pytest.mark.parametrize(("channels", "width", "with_bias"),
                         [(8192, 4, False), (40, 4, True), (136, 3, True), (8, 2, False)])
def test_causal_conv1d_matches_reference(channels: int, width: int, with_bias: bool) -> None:
    from kernels.gated_delta import causal_conv1d

    x, weight, bias, conv_states = _conv_case(channels, width, with_bias, MIXED)
    qsl, slots, fresh, qsl_host = _batch(MIXED)
    before = conv_states.clone()
    expected_states = conv_states.cpu()
    expected = ref.causal_conv1d(x.cpu(), weight.cpu(), None if bias is None else bias.cpu(),
                                 expected_states, slots.cpu(), fresh.cpu(), qsl_host)
    out = torch.full((x.shape[0], channels), math.nan, dtype=torch.bfloat16, device="cuda")
    assert causal_conv1d(x, weight, bias, conv_states, slots, fresh, qsl, out=out) is out
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), expected, **CONV_TOL)
    assert torch.equal(conv_states.cpu(), expected_states)
    # The zero-token sequence's slot and the unused slot are left as they were.
    assert torch.equal(conv_states[[4, 8]], before[[4, 8]])


def test_causal_conv1d_decode_batch_with_int32_slots() -> None:
    from kernels.gated_delta import causal_conv1d

    work = [(1, slot, slot % 5 == 0) for slot in (8, 3, 0, 6, 1, 7, 2, 5)]
    x, weight, _, conv_states = _conv_case(8192, 4, False, work)
    qsl, slots, fresh, qsl_host = _batch(work)
    expected_states = conv_states.cpu()
    expected = ref.causal_conv1d(x.cpu(), weight.cpu(), None, expected_states, slots.cpu(),
                                 fresh.cpu(), qsl_host)
    out = causal_conv1d(x, weight, None, conv_states, slots.int(), fresh, qsl)
    torch.testing.assert_close(out.cpu(), expected, **CONV_TOL)
    assert torch.equal(conv_states.cpu(), expected_states)


# (Hk, Hv, Dk, Dv): Qwen3-Next-80B's linear attention, then small odd ones
# (3 value heads per key head, Dv not a multiple of 64, Dk 256).
RULE_SHAPES = [(16, 32, 128, 128), (2, 6, 64, 32), (1, 1, 256, 64), (4, 4, 128, 96)]


def _rule_case(hk: int, hv: int, dk: int, dv: int,
               work: list[tuple[int, int, bool]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Operands as GatedDeltaNet passes them: q, k, v views of the conv output
    [T, 2 Hk Dk + Hv Dv] (strided rows), a and b columns of a wider tensor."""
    tokens = sum(t for t, _, _ in work)
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, device="cuda",
                        generator=_gen(seed)).to(torch.bfloat16)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    ab = torch.randn(tokens, 2 * hv + 3, device="cuda", generator=_gen(seed + 1)).to(
        torch.bfloat16)
    # Decays as the models learn them: A = 1..16, dt_bias around 0.
    a_log = torch.empty(hv, device="cuda").uniform_(0.0, math.log(16.0), generator=_gen(seed + 2))
    dt_bias = torch.randn(hv, device="cuda", generator=_gen(seed + 3)) * 0.5
    states = torch.randn(NUM_SLOTS, hv, dk, dv, device="cuda", generator=_gen(seed + 4)) * 0.1
    return {"q": q.reshape(tokens, hk, dk), "k": k.reshape(tokens, hk, dk),
            "v": v.reshape(tokens, hv, dv), "a": ab[:, :hv], "b": ab[:, hv + 1:2 * hv + 1],
            "a_log": a_log.to(torch.bfloat16), "dt_bias": dt_bias.to(torch.bfloat16),
            "states": states}


def _reference_rule(case: dict[str, torch.Tensor], slots: torch.Tensor, fresh: torch.Tensor,
                    qsl_host: tuple[int, ...], naive: bool = False) -> tuple[torch.Tensor, ...]:
    cpu = {name: t.cpu() for name, t in case.items()}
    g, beta = ref.gdn_gating(cpu["a"], cpu["b"], cpu["a_log"], cpu["dt_bias"])
    rule = ref.gated_delta_rule_naive if naive else ref.gated_delta_rule
    out = rule(cpu["q"], cpu["k"], cpu["v"], g, beta, cpu["states"], slots.cpu(), fresh.cpu(),
               qsl_host)
    return out, cpu["states"]


def _run_rule(case: dict[str, torch.Tensor], slots: torch.Tensor, fresh: torch.Tensor,
              qsl: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    from kernels.gated_delta import gated_delta_rule

    return gated_delta_rule(case["q"], case["k"], case["v"], case["a"], case["b"],
                            case["a_log"], case["dt_bias"], case["states"], slots, fresh, qsl,
                            out=out)


@pytest.mark.parametrize("shape", RULE_SHAPES)
def test_gated_delta_rule_mixed_batch_matches_reference(shape: tuple[int, ...]) -> None:
    case = _rule_case(*shape, MIXED)
    qsl, slots, fresh, qsl_host = _batch(MIXED)
    before = case["states"].clone()
    expected, expected_states = _reference_rule(case, slots, fresh, qsl_host)
    out = torch.full(case["v"].shape, math.nan, dtype=torch.bfloat16, device="cuda")
    assert _run_rule(case, slots, fresh, qsl, out=out) is out
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), expected, **OUT_TOL)
    torch.testing.assert_close(case["states"].cpu(), expected_states, **STATE_TOL)
    assert torch.equal(case["states"][[4, 8]], before[[4, 8]])


def test_gated_delta_rule_decode_batch_matches_the_recurrence() -> None:
    """64 decode rows at Qwen3-Next's shape, against the per-token reference."""
    work = [(1, slot, slot % 7 == 0) for slot in torch.randperm(64).tolist()]
    case = _rule_case(16, 32, 128, 128, work, seed=5)
    case["states"] = torch.randn(64, 32, 128, 128, device="cuda", generator=_gen(9)) * 0.1
    qsl, slots, fresh, qsl_host = _batch(work)
    expected, expected_states = _reference_rule(case, slots, fresh, qsl_host, naive=True)
    out = _run_rule(case, slots, fresh, qsl)
    torch.testing.assert_close(out.cpu(), expected, **OUT_TOL)
    torch.testing.assert_close(case["states"].cpu(), expected_states, **STATE_TOL)


def test_gated_delta_rule_prompt_in_pieces_equals_one_pass() -> None:
    """A prompt in one step, and the same prompt as a chunk then decode steps,
    end in the same state and give the same outputs (the kernel alone)."""
    work = [(40, 0, True)]
    case = _rule_case(2, 4, 128, 64, work, seed=11)
    qsl, slots, fresh, _ = _batch(work)
    one_pass = _run_rule(case, slots, fresh, qsl).clone()
    final = case["states"][0].clone()
    pieces = [(0, 30)] + [(t, t + 1) for t in range(30, 40)]
    outs = []
    for start, end in pieces:
        piece = dict(case, q=case["q"][start:end], k=case["k"][start:end],
                     v=case["v"][start:end], a=case["a"][start:end], b=case["b"][start:end])
        pqsl, pslots, pfresh, _ = _batch([(end - start, 0, start == 0)])
        outs.append(_run_rule(piece, pslots, pfresh, pqsl))
    torch.testing.assert_close(torch.cat(outs), one_pass, rtol=0, atol=0)
    torch.testing.assert_close(case["states"][0], final, rtol=0, atol=0)


def test_conv_and_rule_replay_in_a_cuda_graph() -> None:
    """Capture conv + delta rule once, replay with new inputs (other lengths,
    slots and fresh flags in the same buffers): equal to eager runs."""
    from kernels.gated_delta import causal_conv1d, gated_delta_rule

    hk, hv, dk, dv, width = 16, 32, 128, 128, 4
    channels = 2 * hk * dk + hv * dv
    first = [(1, 3, False), (2, 0, True), (1, 5, False), (4, 1, False)]
    second = [(3, 2, True), (0, 3, False), (1, 4, False), (4, 6, False)]
    tokens = sum(t for t, _, _ in first)
    x = torch.empty(tokens, channels, dtype=torch.bfloat16, device="cuda")
    ab = torch.empty(tokens, 2 * hv, dtype=torch.bfloat16, device="cuda")
    weight = (torch.randn(channels, width, device="cuda", generator=_gen(1)) * 0.5).to(
        torch.bfloat16)
    a_log = torch.rand(hv, device="cuda", generator=_gen(2)).to(torch.bfloat16)
    dt_bias = torch.randn(hv, device="cuda", generator=_gen(3)).to(torch.bfloat16)
    conv_pool = torch.randn(8, channels, width - 1, device="cuda", generator=_gen(4)).to(
        torch.bfloat16)
    state_pool = torch.randn(8, hv, dk, dv, device="cuda", generator=_gen(5)) * 0.1
    qsl, slots, fresh, _ = _batch(first)
    y = torch.empty_like(x)
    o = torch.empty(tokens, hv, dv, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        causal_conv1d(x, weight, None, conv_pool, slots, fresh, qsl, out=y)
        q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
        gated_delta_rule(q.view(tokens, hk, dk), k.view(tokens, hk, dk), v.view(tokens, hv, dv),
                         ab[:, :hv], ab[:, hv:], a_log, dt_bias, state_pool, slots, fresh, qsl,
                         out=o)

    def load(work: list[tuple[int, int, bool]], seed: int) -> None:
        x.copy_(torch.randn(x.shape, device="cuda", generator=_gen(seed)))
        ab.copy_(torch.randn(ab.shape, device="cuda", generator=_gen(seed + 1)))
        new_qsl, new_slots, new_fresh, _ = _batch(work)
        qsl.copy_(new_qsl)
        slots.copy_(new_slots)
        fresh.copy_(new_fresh)

    pools = (conv_pool.clone(), state_pool.clone())
    load(first, 10)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and loads the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for work, seed in ((first, 20), (second, 30)):
        load(work, seed)
        conv_pool.copy_(pools[0])
        state_pool.copy_(pools[1])
        o.fill_(math.nan)
        graph.replay()
        replayed = (y.clone(), o.clone(), conv_pool.clone(), state_pool.clone())
        conv_pool.copy_(pools[0])
        state_pool.copy_(pools[1])
        o.fill_(math.nan)
        step()
        torch.cuda.synchronize()
        for got, eager in zip(replayed, (y, o, conv_pool, state_pool), strict=True):
            assert torch.equal(got.nan_to_num(7.0), eager.nan_to_num(7.0))
    # The second batch's zero-token sequence wrote nothing into slot 3.
    assert torch.equal(conv_pool[3], pools[0][3]) and torch.equal(state_pool[3], pools[1][3])


def test_cuda_ops_attention_of_rotated_qk_caches_them_unchanged() -> None:
    """CudaOps.attention without a rope_cache (GatedAttention's call: q/k come
    normed and rotated) writes k and v to the cache exactly and attends like
    the reference op."""
    from engine.execution.attention_metadata import AttentionMetadata
    from engine.execution.model_ops import REFERENCE_OPS, CudaOps
    from engine.models import ModelConfig
    from tests.perf.gpu_models import hf_config

    config = ModelConfig.from_hf_config(hf_config("qwen3-0.6b"))
    device = torch.device("cuda")
    ops = CudaOps(config, device, decode_batch=4, max_seq_len=64)
    page = 16
    lengths, new = [20, 7], [20, 1]  # a prompt and a decode row
    tokens = sum(new)
    qkv = torch.randn(tokens, config.qkv_size, device=device, generator=_gen(1)).to(
        torch.bfloat16)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(lengths, new, strict=True)])
    tables = torch.tensor([[3, 0], [1, 0]], dtype=torch.int32)
    mapping = torch.cat([tables[b, p // page] * page + p % page
                         for b, (s, n) in enumerate(zip(lengths, new, strict=True))
                         for p in [torch.arange(s - n, s)]])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 20, 21], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=mapping.to(device),
        max_query_len=20, max_seq_len=20, query_start_loc_host=(0, 20, 21),
        seq_lens_host=tuple(lengths))
    shape = config.kv_cache_shape(4, page)
    k_cache = torch.randn(shape, device=device, generator=_gen(2)).to(torch.bfloat16)
    v_cache = torch.randn(shape, device=device, generator=_gen(3)).to(torch.bfloat16)
    caches32 = (k_cache.float(), v_cache.float())
    out = ops.attention(config, qkv, positions.to(device), meta, (k_cache, v_cache), None,
                        None, None)
    expected = REFERENCE_OPS.attention(config, qkv.float(), positions.to(device), meta,
                                       caches32, None, None, None)
    _, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
    rows = mapping.to(device)
    assert torch.equal(k_cache.view(-1, config.kv_size)[rows], k)
    assert torch.equal(v_cache.view(-1, config.kv_size)[rows], v)
    # The attention kernels round P to bf16: their own tests' relative bound.
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2


def test_cuda_ops_fall_back_to_the_reference_for_head_sizes_not_built() -> None:
    """Tiny hybrid test models (Dk 16) run the reference ops inside CudaOps."""
    from engine.execution.attention_metadata import AttentionMetadata
    from engine.execution.model_ops import REFERENCE_OPS, CudaOps
    from engine.models import ModelConfig
    from tests.perf.gpu_models import hf_config

    ops = CudaOps(ModelConfig.from_hf_config(hf_config("qwen3-0.6b")), torch.device("cuda"),
                  decode_batch=1, max_seq_len=16)
    work = [(3, 1, True), (1, 0, False)]
    qsl, slots, fresh, qsl_host = _batch(work)
    empty = torch.zeros(0, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=empty, block_tables=empty,
                             slot_mapping=empty.long(), max_query_len=3, max_seq_len=0,
                             query_start_loc_host=qsl_host, seq_lens_host=(),
                             state_slots=slots, state_fresh=fresh)
    gen = _gen(0)
    q, k = (torch.randn(4, 1, 16, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    v = torch.randn(4, 2, 16, device="cuda", generator=gen).to(torch.bfloat16)
    a, b = (torch.randn(4, 2, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    a_log, dt_bias = torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda")
    states = torch.randn(2, 2, 16, 16, device="cuda", generator=gen)
    expected_states = states.clone()
    expected = REFERENCE_OPS.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, expected_states,
                                              meta)
    got = ops.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states, meta)
    assert torch.equal(got, expected) and torch.equal(states, expected_states)
