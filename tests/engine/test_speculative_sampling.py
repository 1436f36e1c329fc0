"""Sampled rows under speculation (engine/sampling/verify.py): each token is
distributed exactly as without drafts.

The acceptance rule on hand-built distributions first; then whole engines
over a toy device (tests/engine/fake_device.py) whose model gives every
context a fixed distribution, sampled by the real Sampler at the chunk's
first position and at its draft positions (Sampler.draw_targets, as the
model runner calls it): a chi-square test compares thousands of seeded
generations with the exact distribution of their tokens.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence

import msgspec
import torch

import protocol as p
from engine.execution.model_runner import SampledTokens
from engine.kv.block_hash import kv_fingerprint
from engine.kv.block_pool import BlockPool
from engine.kv.kv_manager import KVManager
from engine.sampling.drafter import may_draft
from engine.sampling.sampler import Sampler
from engine.sampling.verify import accept_drafts
from engine.scheduling.core import EngineCore
from engine.scheduling.scheduler import Scheduler, SchedulerOutput
from engine.scheduling.sequence import Sequence as Seq
from tests.engine.fake_device import VOCAB, FakeDevice, FakeForward
from tests.engine.test_pipeline import results, run

PROMPT = [5, 17, 42, 8, 30]
SAMPLED = p.SamplingParams(max_tokens=4, temperature=0.8, top_k=4, top_p=0.97, ignore_eos=True)
# Chi-square p-values below this fail; with the fixed seeds below, the exact
# rule stays far above it and a wrong one falls far below.
P_FLOOR = 1e-4


def chi_square_p(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit of counts to probs; cells expected fewer than 5 times
    are pooled into one, and a count outside probs' support fails outright."""
    assert set(counts) <= set(probs), f"impossible outcomes: {set(counts) - set(probs)}"
    total = sum(counts.values())
    cells: list[tuple[float, int]] = []
    pooled_expected, pooled_count = 0.0, 0
    for outcome, prob in probs.items():
        expected = prob * total
        if expected < 5:
            pooled_expected += expected
            pooled_count += counts.get(outcome, 0)
        else:
            cells.append((expected, counts.get(outcome, 0)))
    if pooled_expected > 0:
        cells.append((pooled_expected, pooled_count))
    statistic = sum((count - expected) ** 2 / expected for expected, count in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def replace(params: p.SamplingParams, **changed: object) -> p.SamplingParams:
    return msgspec.structs.replace(params, **changed)


def sequence(params: p.SamplingParams, request_id: str = "r") -> Seq:
    return Seq(request_id, [1], params)


# ---- the rule on hand-built distributions ---------------------------------------


def test_a_draft_is_accepted_with_its_probability_and_rejected_to_the_residual() -> None:
    # top_k 3 keeps tokens 1, 3, 2: p = (0.4, 0.25, 0.2) / 0.85 over them.
    raw = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    params = p.SamplingParams(max_tokens=4, temperature=1.0, top_k=3)
    target = {1: 0.4 / 0.85, 2: 0.2 / 0.85, 3: 0.25 / 0.85}
    draws = 6000
    sampler = Sampler(torch.device("cpu"), seed=7)
    seqs = [sequence(params, f"r{i}") for i in range(draws)]
    logits = raw.log().expand(draws, -1).contiguous()
    final = sampler.final_logprobs(logits[:1].clone(), seqs[:1])[0].exp()
    assert torch.allclose(final, torch.tensor([0.0, *(target[t] for t in (1, 2, 3)), 0.0]))
    draft = 1
    # A verify chunk's first token is the sampler's pick; a draft row's is draw_targets'.
    firsts = sampler.sample(logits.clone(), seqs)
    bonus = sampler.draw_targets(logits.clone(), seqs, [1] * draws).tolist()
    outcomes = [accept_drafts(first, [draft], [after]) for first, after in zip(firsts, bonus,
                                                                                 strict=True)]
    accepted = [tokens for tokens in outcomes if len(tokens) == 2]
    # Accepted with probability p(d): a binomial count within 4.5 sigma.
    mean = draws * target[draft]
    assert abs(len(accepted) - mean) < 4.5 * math.sqrt(mean * (1 - target[draft]))
    # Rejected: the token comes from p without d, renormalised.
    rejected = collections.Counter((tokens[0],) for tokens in outcomes if len(tokens) == 1)
    residual = {(t,): q / (1 - target[draft]) for t, q in target.items() if t != draft}
    assert chi_square_p(rejected, residual) > P_FLOOR
    # All accepted: the bonus token comes from p at the last position.
    bonuses = collections.Counter((tokens[1],) for tokens in accepted)
    assert chi_square_p(bonuses, {(t,): q for t, q in target.items()}) > P_FLOOR


def test_a_greedy_draft_row_takes_the_argmax() -> None:
    sampler = Sampler(torch.device("cpu"), seed=3)
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    params = [p.SamplingParams(max_tokens=3, temperature=0.0),
              p.SamplingParams(max_tokens=3, temperature=2.0, top_k=1)]
    seqs = [sequence(params[i % 2], f"g{i}") for i in range(4)]
    assert sampler.draw_targets(logits, seqs, [1, 1, 2, 2]).tolist() == \
        logits.argmax(dim=-1).tolist()


def test_sampled_rows_may_draft_but_not_while_scoring_their_prompt() -> None:
    assert may_draft(SAMPLED)
    assert may_draft(p.SamplingParams(max_tokens=4, temperature=1.2, min_p=0.1, seed=3))
    # Bias, penalty and logprobs rows draft (tests/engine/test_speculation_logits.py).
    assert may_draft(p.SamplingParams(max_tokens=4, temperature=0.8, logprobs=0,
                                      logit_bias={3: 1.0}, frequency_penalty=0.5))
    # (Grammar rows draft too: tests/engine/test_speculation.py.)
    for changed in ({"prompt_logprobs": 0},):
        params = p.SamplingParams(max_tokens=4, temperature=0.8, **changed)  # type: ignore[arg-type]
        assert not may_draft(params), changed


# ---- whole engines over a toy device -----------------------------------------------


def toy_logits(context: Sequence[int]) -> torch.Tensor:
    """The toy model's logits after a context: fixed per context, peaked
    enough that its top tokens are drafted and accepted often."""
    key = len(context)
    for token in context:
        key = (key * 1_000_003 + token) % (1 << 61)
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(key)) * 2.0


class SamplingDevice(FakeDevice):
    """FakeDevice whose rows are sampled by a real Sampler from toy_logits:
    at each chunk's sampling row as Sampler.sample does, at draft rows as
    the model runner does (Sampler.draw_targets)."""

    def __init__(self, scheduler: Scheduler, lanes: int, sampler: Sampler) -> None:
        super().__init__(scheduler, lanes)
        self.sampler = sampler

    def _model_token(self, inputs, row, seq_row):  # type: ignore[no-untyped-def,override]
        # The context the toy model sees at that row; forward() samples it.
        table = inputs.block_tables[seq_row]
        return [self.kv[int(table[pos // self.page_size]) * self.page_size + pos % self.page_size]
                for pos in range(int(inputs.positions[row]) + 1)]

    def forward(self, out: SchedulerOutput, draft_masks: object = None) -> FakeForward:
        step = super().forward(out, draft_masks)  # type: ignore[arg-type]
        inputs = step.inputs
        if step.logits is not None:
            contexts = list(step.logits)  # type: ignore[call-overload]
            step.logits = self.sampler.sample(torch.stack([toy_logits(c) for c in contexts]),
                                              inputs.sample_seqs)
        if step.verified is not None:
            logits = torch.stack([toy_logits(c) for c in step.verified.tolist()])  # type: ignore[arg-type]
            step.verified = SampledTokens(self.sampler.draw_targets(
                logits, inputs.draft_seqs, inputs.draft_positions).tolist())
        return step


class ArgmaxDrafter:
    """Guesses the toy model's most likely tokens: accepted often, not always."""

    def __init__(self) -> None:
        self.proposed = 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        context, draft = list(token_ids), []
        for _ in range(max_tokens):
            draft.append(int(toy_logits(context).argmax()))
            context.append(draft[-1])
        self.proposed += len(draft)
        return draft


def sample_engine(draft: bool, lanes: int = 128) -> tuple[EngineCore, list[p.EngineEvent]]:
    kv = KVManager(BlockPool(2048, 4), kv_fingerprint("toy"), 8, 64)
    scheduler = Scheduler(kv, max_concurrency=lanes, max_batched_tokens=1024, max_context=64,
                          drafter=ArgmaxDrafter() if draft else None, draft_tokens=3)
    sampler = Sampler(torch.device("cpu"), seed=11)
    device = SamplingDevice(scheduler, lanes, sampler)
    events: list[p.EngineEvent] = []
    core = EngineCore(device, scheduler, sampler,  # type: ignore[arg-type]
                      vocab_size=VOCAB, emit=events.append)
    return core, events


def generate_all(core: EngineCore, events: list[p.EngineEvent],
                 requests: dict[str, tuple[list[int], p.SamplingParams]]) -> dict[str, list[int]]:
    events.clear()
    for request_id, (prompt, params) in requests.items():
        core.handle(p.Generate(request_id, prompt, params))
    run(core, max_steps=100_000)
    return {request_id: tokens for request_id, (tokens, _) in results(events).items()}


def exact_distribution(prompt: list[int], params: p.SamplingParams) -> dict[tuple[int, ...], float]:
    """Every max_tokens-long output of the toy model and its probability."""
    sampler = Sampler(torch.device("cpu"))
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(params.max_tokens):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, prob in probs.items():
            final = sampler.final_logprobs(toy_logits(prompt + list(prefix)).unsqueeze(0),
                                           [sequence(params)])[0].exp()
            for token in final.nonzero().flatten().tolist():
                grown[(*prefix, token)] = prob * float(final[token])
        probs = grown
    return probs


def test_drafted_samples_follow_the_target_distribution_exactly() -> None:
    """4,000 seeded 4-token generations with drafts of up to 3 tokens, against
    the exact joint distribution of the 4 tokens (and the same without
    drafts, the test's own control)."""
    requests = {f"r{i}": (PROMPT, replace(SAMPLED, seed=i)) for i in range(4000)}
    probs = exact_distribution(PROMPT, SAMPLED)
    core, events = sample_engine(draft=True)
    drafted = generate_all(core, events, requests)
    stats = core._stats
    # Drafts were verified in earnest: many accepted, many rejected.
    assert 0.3 * stats.draft_tokens_total < stats.draft_accepted_tokens_total \
        < 0.9 * stats.draft_tokens_total, stats
    p_drafted = chi_square_p(collections.Counter(map(tuple, drafted.values())), probs)
    plain_core, plain_events = sample_engine(draft=False)
    plain = generate_all(plain_core, plain_events, requests)
    p_plain = chi_square_p(collections.Counter(map(tuple, plain.values())), probs)
    print(f"chi-square p-values: drafted {p_drafted:.3g}, plain {p_plain:.3g}")
    assert p_drafted > P_FLOOR and p_plain > P_FLOOR, (p_drafted, p_plain)
    assert core.scheduler.kv.pool.num_used == 0


def test_seeded_drafted_samples_are_reproducible_and_leave_other_rows_alone() -> None:
    sampled = {f"s{i}": (PROMPT[: 3 + i % 3], replace(SAMPLED, max_tokens=9, seed=100 + i))
               for i in range(6)}
    greedy = {f"g{i}": (PROMPT[i % 3 :], p.SamplingParams(max_tokens=9, temperature=0.0))
              for i in range(3)}
    # Sampled rows that cannot draft (they score their prompt): their tokens
    # are those without drafts.
    biased = {f"b{i}": (PROMPT, replace(SAMPLED, max_tokens=9, seed=200 + i, prompt_logprobs=0))
              for i in range(3)}
    batch = {**sampled, **greedy, **biased}
    first_core, first_events = sample_engine(draft=True, lanes=8)
    first = generate_all(first_core, first_events, batch)
    again_core, again_events = sample_engine(draft=True, lanes=8)
    assert generate_all(again_core, again_events, batch) == first
    assert first_core._stats.draft_accepted_tokens_total > 0
    plain_core, plain_events = sample_engine(draft=False, lanes=8)
    plain = generate_all(plain_core, plain_events, batch)
    for request_id in (*greedy, *biased):
        assert first[request_id] == plain[request_id], request_id
    assert all(len(tokens) == 9 for tokens in first.values())


def test_every_outcome_is_possible() -> None:
    """The exact distribution the chi-square test uses sums to 1 over the
    outputs the sampler allows (guards the test's own arithmetic)."""
    probs = exact_distribution(PROMPT, SAMPLED)
    assert math.isclose(sum(probs.values()), 1.0, rel_tol=1e-6)
    assert len(probs) <= 4 ** SAMPLED.max_tokens
    assert all(len(outcome) == SAMPLED.max_tokens for outcome in itertools.islice(probs, 10))
