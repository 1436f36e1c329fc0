"""kernels.moe (routing and the expert GEMV) against kernels.moe_reference.

Routing: the kernel's order is exactly "probability descending, lower expert
first among equals"; for bf16 (or well-spread float32) logits that is a stable
descending sort of the logits, checked bit for bit, while the weights match
route_topk to float32 rounding (softmax sums in another order).

Expert GEMV: against an emulation in torch of the kernel's rounding steps
(float64 dot products standing in for its float32 ones), which must agree
bit for bit except for rare elements where the float32 sums land across a
bf16 rounding boundary; and against moe_reference.moe_experts, which adds the
weighted contributions in bf16 in expert order, to within bf16 rounding of
the output's scale.
"""

from __future__ import annotations

import pytest
import torch

from kernels import moe_reference

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
# name: (E, k, H, I)
EXPERT_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-small": (8, 2, 1024, 1792),
    # H and I not multiples of the 256-wide warp span, odd k: partial chunks.
    "tiny": (5, 3, 72, 40),
}
TOKENS = [1, 2, 7, 32]


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns mapped to integers that step by one per ulp across zero."""
    bits = x.contiguous().view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 ulp at |x| (float32), with a floor for zeros."""
    exponent = torch.floor(torch.log2(x.abs().float().clamp_min(2.0**-100)))
    return torch.exp2(exponent - 7)


# ---------------------------------------------------------------- routing


def expected_ids(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Higher logit first, lower expert first among equal logits."""
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices
    return order[:, :top_k].int()


def check_route(logits: torch.Tensor, top_k: int, normalize: bool) -> None:
    from kernels.moe import moe_route

    ref_weights, ref_ids = moe_reference.route_topk(logits, top_k, normalize)
    weights, ids = moe_route(logits, top_k, normalize)
    torch.cuda.synchronize()
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids, expected_ids(logits, top_k)), (ids, expected_ids(logits, top_k))
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)
    # torch.topk documents no order among equal values: match its ids only
    # where the value it picked is held by no other expert.
    picked = logits.float().gather(1, ref_ids)
    ties = (logits.float().unsqueeze(1) == picked.unsqueeze(2)).sum(dim=2)
    unique = ties == 1
    assert torch.equal(ids.long()[unique], ref_ids[unique])


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("experts", [8, 60, 128])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_route_matches_reference(normalize: bool, experts: int, top_k: int, tokens: int) -> None:
    seed = experts * 1000 + top_k * 100 + tokens
    logits = (2.0 * torch.randn(tokens, experts, device="cuda", generator=generator(seed))).to(BF16)
    check_route(logits, top_k, normalize)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(("experts", "top_k"), [(1, 1), (33, 16), (512, 16), (512, 1), (256, 8)])
def test_route_edges_and_float32_logits(normalize: bool, experts: int, top_k: int) -> None:
    gen = generator(experts + top_k)
    logits = 3.0 * torch.randn(9, experts, device="cuda", generator=gen)
    check_route(logits.to(BF16), top_k, normalize)
    check_route(logits, top_k, normalize)


@pytest.mark.parametrize("normalize", [False, True])
def test_route_exact_ties_prefer_the_lower_expert(normalize: bool) -> None:
    # Integer logits in a small range: many equal probabilities, also across
    # the k-th place, and whole rows of one value.
    gen = generator(5)
    logits = torch.randint(-2, 3, (64, 128), device="cuda", generator=gen).to(BF16)
    logits[0] = 1.0
    logits[1, 100:] = 7.0  # the top 8 are 100..107 in that order
    check_route(logits, 8, normalize)
    check_route(logits.float(), 8, normalize)
    from kernels.moe import moe_route

    _, ids = moe_route(logits, 8, normalize)
    assert ids[0].tolist() == list(range(8))
    assert ids[1].tolist() == list(range(100, 108))


def test_route_fills_given_outputs_and_rejects_bad_inputs() -> None:
    from kernels.moe import moe_route

    logits = torch.randn(6, 16, device="cuda", dtype=BF16)
    weights = torch.full((6, 4), float("nan"), device="cuda")
    ids = torch.full((6, 4), -7, device="cuda", dtype=torch.int32)
    got_weights, got_ids = moe_route(logits, 4, True, weights_out=weights, ids_out=ids)
    assert got_weights is weights and got_ids is ids
    assert torch.equal(ids, expected_ids(logits, 4))
    assert not weights.isnan().any()
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(6, device="cuda"))
    empty_weights, empty_ids = moe_route(logits[:0], 4, True)
    assert empty_weights.shape == empty_ids.shape == (0, 4)
    bad_calls = [
        lambda: moe_route(logits.half(), 4, True),
        lambda: moe_route(logits.cpu(), 4, True),
        lambda: moe_route(logits[0], 4, True),
        lambda: moe_route(torch.randn(16, 6, device="cuda", dtype=BF16).t(), 4, True),
        lambda: moe_route(logits, 0, True),
        lambda: moe_route(logits, 17, True),
        lambda: moe_route(torch.randn(2, 4, device="cuda"), 5, True),
        lambda: moe_route(torch.randn(2, 513, device="cuda"), 2, True),
        lambda: moe_route(logits, 4, True, weights_out=weights[:, :3].contiguous()),
        lambda: moe_route(logits, 4, True, weights_out=weights.double()),
        lambda: moe_route(logits, 4, True, ids_out=ids.long()),
        lambda: moe_route(logits, 4, True, ids_out=ids.t().contiguous()),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


# ---------------------------------------------------------------- expert GEMV


def random_experts(experts: int, hidden_size: int, intermediate: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H] and down [E, H, I] at Linear-init scale, one scale per expert."""
    gen = generator(seed)
    scale = torch.linspace(0.5, 2.0, experts, device="cuda").view(experts, 1, 1)
    gate_up = torch.randn(experts, 2 * intermediate, hidden_size, device="cuda", generator=gen)
    down = torch.randn(experts, hidden_size, intermediate, device="cuda", generator=gen)
    return ((gate_up * scale / hidden_size**0.5).to(BF16),
            (down * scale / intermediate**0.5).to(BF16))


def random_routing(tokens: int, experts: int, top_k: int, hidden_size: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden bf16 [T, H] (rows of different scales), ids int32 [T, k] (distinct
    per token, as a router picks), weights float32 [T, k] (normalized top-k)."""
    gen = generator(seed)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen)
    hidden *= torch.linspace(0.5, 3.0, tokens, device="cuda").unsqueeze(1)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = moe_reference.route_topk(logits, top_k, normalize=True)
    return hidden.to(BF16), ids.int().contiguous(), weights.contiguous()


def emulate(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's rounding steps in torch (float64 dots for its float32 ones):
    (act bf16 [T*k, I], contributions c bf16 [T, k, H], out bf16 [T, H])."""
    tokens, top_k = ids.shape
    intermediate = down.shape[2]
    flat = ids.reshape(-1).long()
    rows = torch.arange(tokens * top_k, device="cuda") // top_k
    act = torch.empty(tokens * top_k, intermediate, device="cuda", dtype=BF16)
    y = torch.empty(tokens * top_k, hidden.shape[1], device="cuda", dtype=BF16)
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        x = hidden[rows[pairs]].double()
        gate, up = (x @ gate_up[expert].double().t()).to(BF16).float().chunk(2, dim=1)
        silu = (gate / (1.0 + torch.exp(-gate))).to(BF16).float()
        act[pairs] = (silu * up).to(BF16)
        y[pairs] = (act[pairs].double() @ down[expert].double().t()).to(BF16)
    c = (y.float() * weights.reshape(-1, 1)).to(BF16).view(tokens, top_k, -1)
    total = c[:, 0].float()
    for slot in range(1, top_k):
        total = total + c[:, slot].float()
    return act, c, total.to(BF16)


def assert_matches_emulation(out: torch.Tensor, act: torch.Tensor, hidden: torch.Tensor,
                             gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                             weights: torch.Tensor) -> None:
    want_act, c, want_out = emulate(hidden, gate_up, down, ids, weights)
    assert not act.isnan().any(), "unwritten (NaN-poisoned) activations"
    act_differing = int((act != want_act).sum())
    assert act_differing <= 4 + 1e-2 * act.numel(), f"act: {act_differing} of {act.numel()} differ"
    # Where g or u nearly cancel, float32 and float64 sums round to bf16
    # values several of their own ulps apart: bound by the pair's scale too.
    act_error = (act.float() - want_act.float()).abs()
    act_bound = 4 * bf16_ulp(want_act) + 2.0**-10 * want_act.float().abs().amax(dim=1, keepdim=True)
    assert bool((act_error <= act_bound).all()), \
        f"act: worst error / bound {float((act_error / act_bound).max()):.2f}"

    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN outputs"
    differing = int((out != want_out).sum())
    # Each of the k contributions rounds y (a float32 sum over I here, float64
    # in the emulation) to bf16: one in ~50 lands across a rounding boundary,
    # so with k = 8 about one output in ten differs by an ulp (measured on the
    # H200: 151 of 2048 at the 30B-A3B shape). The bound below is the check.
    assert differing <= 4 + 0.15 * out.numel(), f"out: {differing} of {out.numel()} differ"
    # Each contribution may be a few of its ulps off, plus the final rounding
    # (and, where y nearly cancels, an error at the row's scale).
    bound = (2 * ids.shape[1] + 1) * bf16_ulp(c.float().abs().amax(dim=1)) \
        + 2.0**-10 * want_out.float().abs().amax(dim=1, keepdim=True)
    error = (out.float() - want_out.float()).abs()
    assert bool((error <= bound).all()), f"out: worst error / bound {float((error / bound).max()):.2f}"


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, top_k: int) -> None:
    """Within bf16 rounding of the row's scale: the reference rounds after each
    of its k bf16 additions, we once."""
    scale = ref.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    error = (out.float() - ref.float()).abs() / scale
    assert float(error.max()) <= (top_k + 2) * 2.0**-8, f"max error / row scale {float(error.max()):.2e}"
    relative = (out.float() - ref.float()).norm() / ref.float().norm()
    assert relative < 1e-2, f"relative error {float(relative):.2e}"


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", sorted(EXPERT_SHAPES))
def test_experts_gemv_matches_reference(shape: str, tokens: int) -> None:
    from kernels.moe import moe_experts_gemv, moe_gemv_workspace

    experts, top_k, hidden_size, intermediate = EXPERT_SHAPES[shape]
    gate_up, down = random_experts(experts, hidden_size, intermediate, seed=experts + tokens)
    hidden, ids, weights = random_routing(tokens, experts, top_k, hidden_size, seed=tokens)
    before = [t.clone() for t in (hidden, gate_up, down, ids, weights)]
    workspace = moe_gemv_workspace(tokens * top_k + 3, intermediate, "cuda")
    workspace.fill_(float("nan"))
    out = torch.full((tokens, hidden_size), float("nan"), device="cuda", dtype=BF16)
    result = moe_experts_gemv(hidden, gate_up, down, ids, weights, out=out, workspace=workspace)
    torch.cuda.synchronize()
    assert result is out
    assert workspace[tokens * top_k:].isnan().all(), "wrote past its pairs' workspace rows"
    assert_matches_emulation(out, workspace[:tokens * top_k], hidden, gate_up, down, ids, weights)
    ref = moe_reference.moe_experts(hidden, gate_up, down, ids.long(), weights)
    assert_close_to_reference(out, ref, top_k)
    # Allocated outputs, and the same bits again (fixed reduction orders).
    again = moe_experts_gemv(hidden, gate_up, down, ids, weights)
    assert again.shape == (tokens, hidden_size) and again.dtype == BF16
    assert torch.equal(again, out)
    for tensor, copy in zip((hidden, gate_up, down, ids, weights), before, strict=True):
        assert torch.equal(tensor, copy), "an input changed"


def test_experts_gemv_bf16_routing_weights_match_the_reference() -> None:
    """An architecture that weighs in bf16 passes its weights as float32: the
    product of a bf16 y and a bf16-valued float32 weight rounds as bf16 * bf16."""
    from kernels.moe import moe_experts_gemv

    experts, top_k, hidden_size, intermediate = EXPERT_SHAPES["mixtral-small"]
    gate_up, down = random_experts(experts, hidden_size, intermediate, seed=3)
    hidden, ids, weights = random_routing(7, experts, top_k, hidden_size, seed=4)
    bf16_weights = weights.to(BF16)
    out = moe_experts_gemv(hidden, gate_up, down, ids, bf16_weights.float())
    ref = moe_reference.moe_experts(hidden, gate_up, down, ids.long(), bf16_weights)
    assert_close_to_reference(out, ref, top_k)


def test_experts_gemv_every_token_on_the_same_experts() -> None:
    from kernels.moe import moe_experts_gemv

    experts, top_k, hidden_size, intermediate = EXPERT_SHAPES["qwen3-30b-a3b"]
    gate_up, down = random_experts(experts, hidden_size, intermediate, seed=8)
    hidden, _, weights = random_routing(32, experts, top_k, hidden_size, seed=9)
    ids = torch.tensor([[77, 3, 127, 0, 64, 12, 100, 5]] * 32, device="cuda", dtype=torch.int32)
    workspace = torch.full((32 * top_k, intermediate), float("nan"), device="cuda", dtype=BF16)
    out = moe_experts_gemv(hidden, gate_up, down, ids, weights, workspace=workspace)
    torch.cuda.synchronize()
    assert_matches_emulation(out, workspace, hidden, gate_up, down, ids, weights)
    assert_close_to_reference(out, moe_reference.moe_experts(hidden, gate_up, down, ids.long(),
                                                              weights), top_k)


@pytest.mark.parametrize("tokens", [1, 8])
def test_experts_gemv_reads_host_stacks_and_cached_experts_exactly(tokens: int) -> None:
    """Host-resident experts (page-locked stacks read over the bus) with some
    of them in a device cache give the bits of device-resident stacks."""
    from kernels.moe import ExpertCacheView, moe_experts_gemv

    experts, top_k, hidden_size, intermediate = EXPERT_SHAPES["qwen3-30b-a3b"]
    gate_up, down = random_experts(experts, hidden_size, intermediate, seed=20)
    hidden, ids, weights = random_routing(tokens, experts, top_k, hidden_size, seed=21)
    want = moe_experts_gemv(hidden, gate_up, down, ids, weights)
    host_gate_up, host_down = gate_up.cpu().pin_memory(), down.cpu().pin_memory()
    assert torch.equal(moe_experts_gemv(hidden, host_gate_up, host_down, ids, weights), want)
    # Half of the picked experts (and one nobody picked) cached, in scrambled
    # slots; slot 0 holds NaN and no expert.
    picked = sorted(set(ids.flatten().tolist()))
    cached = [*picked[::2], next(e for e in range(experts) if e not in picked)]
    slots = torch.full((experts,), -1, dtype=torch.int32)
    cache_gate_up = torch.full((len(cached) + 1, 2 * intermediate, hidden_size), float("nan"),
                               dtype=BF16, device="cuda")
    cache_down = torch.full((len(cached) + 1, hidden_size, intermediate), float("nan"),
                            dtype=BF16, device="cuda")
    for slot, expert in zip(range(len(cached), 0, -1), cached, strict=True):
        slots[expert] = slot
        cache_gate_up[slot] = gate_up[expert]
        cache_down[slot] = down[expert]
    view = ExpertCacheView(slots.cuda(), cache_gate_up, cache_down)
    got = moe_experts_gemv(hidden, host_gate_up, host_down, ids, weights, cache=view)
    assert torch.equal(got, want)
    # The cache is really read: a cached expert's copy changed changes the output.
    cache_down[len(cached)].zero_()
    changed = moe_experts_gemv(hidden, host_gate_up, host_down, ids, weights, cache=view)
    assert not torch.equal(changed, want)


def test_experts_gemv_ignores_out_of_range_ids() -> None:
    """An id outside [0, E) adds nothing: the same bits as a zero weight."""
    from kernels.moe import moe_experts_gemv

    experts, top_k, hidden_size, intermediate = EXPERT_SHAPES["tiny"]
    gate_up, down = random_experts(experts, hidden_size, intermediate, seed=10)
    hidden, ids, weights = random_routing(6, experts, top_k, hidden_size, seed=11)
    bad_ids = ids.clone()
    bad_ids[:3, 1] = -1
    bad_ids[3:, 2] = experts
    zeroed = weights.clone()
    zeroed[:3, 1] = 0.0
    zeroed[3:, 2] = 0.0
    got = moe_experts_gemv(hidden, gate_up, down, bad_ids, weights)
    want = moe_experts_gemv(hidden, gate_up, down, ids, zeroed)
    assert torch.equal(got, want)


def test_experts_gemv_cuda_graph_replay_with_new_inputs() -> None:
    """Both kernels captured with preallocated out and workspace, replayed after
    new hidden, ids and weights are copied into the static inputs."""
    from kernels.moe import moe_experts_gemv, moe_gemv_workspace

    experts, top_k, hidden_size, intermediate = EXPERT_SHAPES["qwen3-30b-a3b"]
    tokens = 4
    gate_up, down = random_experts(experts, hidden_size, intermediate, seed=12)
    hidden, ids, weights = random_routing(tokens, experts, top_k, hidden_size, seed=13)
    out = torch.empty(tokens, hidden_size, device="cuda", dtype=BF16)
    workspace = moe_gemv_workspace(tokens * top_k, intermediate, "cuda")
    moe_experts_gemv(hidden, gate_up, down, ids, weights, out=out, workspace=workspace)
    torch.cuda.synchronize()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_experts_gemv(hidden, gate_up, down, ids, weights, out=out, workspace=workspace)
    for seed in (14, 15):
        new_hidden, new_ids, new_weights = random_routing(tokens, experts, top_k, hidden_size, seed)
        hidden.copy_(new_hidden)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = moe_experts_gemv(new_hidden, gate_up, down, new_ids, new_weights)
        assert torch.equal(out, eager), f"replay seed {seed}"


def test_route_and_experts_captured_together() -> None:
    """The decode step's whole MoE block in one graph: logits -> route -> experts."""
    from kernels.moe import moe_experts_gemv, moe_gemv_workspace, moe_route

    experts, top_k, hidden_size, intermediate = EXPERT_SHAPES["qwen3-30b-a3b"]
    tokens = 3
    gate_up, down = random_experts(experts, hidden_size, intermediate, seed=16)
    hidden = torch.randn(tokens, hidden_size, device="cuda").to(BF16)
    logits = torch.randn(tokens, experts, device="cuda").to(BF16)
    weights = torch.empty(tokens, top_k, device="cuda")
    ids = torch.empty(tokens, top_k, device="cuda", dtype=torch.int32)
    out = torch.empty(tokens, hidden_size, device="cuda", dtype=BF16)
    workspace = moe_gemv_workspace(tokens * top_k, intermediate, "cuda")

    def step() -> None:
        moe_route(logits, top_k, True, weights_out=weights, ids_out=ids)
        moe_experts_gemv(hidden, gate_up, down, ids, weights, out=out, workspace=workspace)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (17, 18):
        gen = generator(seed)
        new_logits = torch.randn(tokens, experts, device="cuda", generator=gen).to(BF16)
        new_hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).to(BF16)
        logits.copy_(new_logits)
        hidden.copy_(new_hidden)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # bf16 logits tie often: the reference runs on the kernel's own
        # routing, which is checked against route_topk's separately.
        ref_weights, _ = moe_reference.route_topk(new_logits, top_k, True)
        assert torch.equal(ids, expected_ids(new_logits, top_k))
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)
        ref = moe_reference.moe_experts(new_hidden, gate_up, down, ids.long(), weights)
        assert_close_to_reference(out, ref, top_k)


def test_experts_gemv_zero_tokens_and_bad_inputs() -> None:
    from kernels.moe import moe_experts_gemv

    experts, top_k, hidden_size, intermediate = EXPERT_SHAPES["tiny"]
    gate_up, down = random_experts(experts, hidden_size, intermediate, seed=19)
    hidden, ids, weights = random_routing(3, experts, top_k, hidden_size, seed=20)
    empty = moe_experts_gemv(hidden[:0], gate_up, down, ids[:0], weights[:0])
    assert empty.shape == (0, hidden_size)
    misaligned = torch.randn(3 * hidden_size + 1, device="cuda").to(BF16)[1:].view(3, hidden_size)
    odd_h = torch.randn(3, 68, device="cuda", dtype=BF16)
    out = torch.empty(3, hidden_size, device="cuda", dtype=BF16)
    bad_calls = [
        lambda: moe_experts_gemv(hidden.float(), gate_up, down, ids, weights),
        lambda: moe_experts_gemv(hidden.cpu(), gate_up, down, ids, weights),
        lambda: moe_experts_gemv(hidden, gate_up.float(), down, ids, weights),
        lambda: moe_experts_gemv(hidden, gate_up, down.transpose(1, 2), ids, weights),
        lambda: moe_experts_gemv(hidden, gate_up, down[:, :, :32].contiguous(), ids, weights),
        lambda: moe_experts_gemv(hidden, gate_up[:-1], down, ids, weights),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids.long(), weights),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids, weights.to(BF16)),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids[:2], weights[:2]),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids, weights[:, :2].contiguous()),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids.t(), weights.t()),
        lambda: moe_experts_gemv(misaligned, gate_up, down, ids, weights),
        lambda: moe_experts_gemv(odd_h, torch.randn(experts, 2 * intermediate, 68, device="cuda",
                                                    dtype=BF16),
                                 torch.randn(experts, 68, intermediate, device="cuda", dtype=BF16),
                                 ids, weights),
        lambda: moe_experts_gemv(hidden, gate_up[:, :36].contiguous(),
                                 down[:, :, :18].contiguous(), ids, weights),  # I = 18
        lambda: moe_experts_gemv(hidden, gate_up, down, ids.repeat(1, 6), weights.repeat(1, 6)),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids, weights, out=out[:2]),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids, weights, out=out.float()),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids, weights, out=hidden),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids, weights,
                                 workspace=torch.empty(8, intermediate, device="cuda", dtype=BF16)),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids, weights,
                                 workspace=torch.empty(9, 48, device="cuda", dtype=BF16)),
        lambda: moe_experts_gemv(hidden, gate_up, down, ids, weights,
                                 workspace=gate_up.view(-1)[:9 * intermediate].view(9, -1)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    # F.linear-shaped misuse: a 2-D expert matrix.
    with pytest.raises(ValueError):
        moe_experts_gemv(hidden, gate_up[0], down, ids, weights)
