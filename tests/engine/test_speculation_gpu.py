"""Speculative decoding on CUDA (bf16, our kernels, verify steps replayed
from the decode CUDA graphs as decode rows): the target tokens reach the host through
their own page-locked buffer, accepted and rejected drafts leave the tokens
exactly those of the same engine without speculation, greedy and sampled,
and no page leaks (tests/engine/test_speculation.py on CUDA).

Exactness needs the verify step to compute each position as plain decoding
does: it runs as decode rows (the decode kernel, the decode graphs), and
every test keeps a verify step within 8 rows (batch x (1 + drafts) <= 8),
where the small model's projections run the skinny GEMM for plain decoding
and verifying alike (its rows do not depend on how many share the call;
cuBLAS above 8 rows rounds differently, and in bf16 a near tie then goes
either way: the engine promises greedy tokens identical to plain decoding
on the GPU only within such a batch-invariant regime).

A random model seldom repeats itself, so n-gram lookup alone would rarely
draft here: an oracle drafter proposes the plain run's own continuation,
wrong at fixed positions, so every verify step mixes accepted and rejected
drafts.
Run on the lent GPU: pytest -m gpu this file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest

import protocol as p
from engine.sampling.drafter import Drafter
from tests.engine import in_process
from tests.engine.in_process import run_to_completion
from tests.engine.test_gpu_engine import _release
from tests.engine.test_host_kv_tier_gpu import PAGE, prompt, qwen3_bf16

pytestmark = pytest.mark.gpu
__all__ = ["qwen3_bf16"]  # the module's fixture, shared


class OracleDrafter:
    """Proposes what followed in a known run (each request's prompt and its
    plain tokens), one token in every `wrong_every` turned wrong."""

    def __init__(self, runs: list[list[int]], wrong_every: int = 3) -> None:
        self.runs = runs
        self.wrong_every = wrong_every
        self.proposed = 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        known = list(token_ids)
        for run in self.runs:
            if run[:len(known)] == known:
                draft = run[len(known):len(known) + max_tokens]
                draft = [token + 1 if (len(known) + i) % self.wrong_every == 0 else token
                         for i, token in enumerate(draft)]
                self.proposed += len(draft)
                return draft
        return []


def tokens_of(model: Path, requests: dict[str, tuple[list[int], p.SamplingParams]],
              drafter: Drafter | None = None, graph_rounds: list[int] | None = None,
              **options: object) -> tuple[dict[str, list[int]], int]:
    """Each request's tokens, and the draft tokens accepted; graph_rounds
    gets a draft model's rounds drafted through its CUDA graphs."""
    core, events = in_process.make_engine(model, **{
        "device": "cuda", "dtype": "bfloat16", "page_size": PAGE, "max_concurrency": 4,
        "max_batched_tokens": 256, "kv_capacity_tokens": 4096, **options})
    if drafter is not None:
        assert core.scheduler.drafter is not None
        core.scheduler.drafter = drafter
    found: dict[str, list[int]] = {name: [] for name in requests}
    for event in run_to_completion(core, events, requests):
        assert isinstance(event, p.StepOutputs)
        for output in event.outputs:
            found[output.request_id].extend(output.token_ids)
    pool = core.scheduler.kv.pool
    assert pool.num_used == 0 and core.scheduler.kv.outstanding == 0
    accepted = core._stats.draft_accepted_tokens_total
    if graph_rounds is not None:
        graph_rounds.append(core.scheduler.drafter.graph_rounds)  # type: ignore[union-attr]
    _release(core)
    return found, accepted


@pytest.mark.parametrize(("names", "draft_tokens"), [(("long", "sampled"), 3), (("plain",), 7)])
def test_speculation_on_cuda_matches_plain_decoding(qwen3_bf16: Path, names: tuple[str, ...],
                                                    draft_tokens: int) -> None:
    greedy = p.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    every = {"long": (prompt(3, 120), greedy), "plain": (prompt(4, 100), greedy),
             "sampled": (prompt(5, 60), p.SamplingParams(max_tokens=32, temperature=0.8,
                                                         seed=3, ignore_eos=True))}
    requests = {name: every[name] for name in names}
    want, _ = tokens_of(qwen3_bf16, requests)
    oracle = OracleDrafter([ids + want[name] for name, (ids, _) in requests.items()])
    got, accepted = tokens_of(qwen3_bf16, requests, oracle, spec="ngram",
                              draft_tokens=draft_tokens)
    assert got == want
    assert 0 < accepted < oracle.proposed


def test_ngram_speculation_on_cuda_keeps_the_tokens(qwen3_bf16: Path) -> None:
    """The shipped drafter end to end on a prompt that repeats a block."""
    block = prompt(6, 40)
    greedy = p.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    requests = {"repeat": (block * 3, greedy), "plain": (prompt(7, 80), greedy)}
    want, _ = tokens_of(qwen3_bf16, requests)
    got, _ = tokens_of(qwen3_bf16, requests, spec="ngram", draft_tokens=3)
    assert got == want


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_a_draft_model_on_cuda_keeps_the_tokens(qwen3_bf16: Path, cuda_graph: bool) -> None:
    """--spec draft with the target as its own draft (engine/sampling/draft_model.py):
    eagerly, our kernels run the draft's catch-up (prefill kernel) and its
    guesses (decode kernel); with graphs, a round after the first replays
    the draft's catch-up and guess chain (engine/execution/draft_graphs.py).
    The tokens are the plain run's, and nearly every guess is kept (bf16: the
    draft's guesses run fewer rows a call than the verify step, and past the
    skinny GEMM's rows a near tie may round apart)."""
    greedy = p.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = {"long": (prompt(8, 300), greedy),
                "sampled": (prompt(10, 90), p.SamplingParams(max_tokens=24, temperature=0.8,
                                                             seed=4, ignore_eos=True))}
    want, _ = tokens_of(qwen3_bf16, requests, max_batched_tokens=512)
    rounds: list[int] = []
    got, accepted = tokens_of(qwen3_bf16, requests, spec="draft", max_batched_tokens=512,
                              draft_model=str(qwen3_bf16), draft_tokens=3,
                              cuda_graph=cuda_graph, graph_rounds=rounds)
    # About ten rounds (40 tokens, 3 drafts, nearly all kept): the first
    # catches up on the whole prompt eagerly, the others replay the graphs.
    assert (rounds[0] >= 5) if cuda_graph else rounds == [0]
    assert len(got.pop("sampled")) == len(want.pop("sampled"))
    assert got == want
    assert accepted > 20


# Two rows a batch with 3 drafts: a verify step stays within 8 rows (above).
@pytest.mark.parametrize("names", [("greedy", "budget"), ("sampled", "plain")])
def test_grammar_and_budget_rows_draft_exactly_on_cuda(tiny_qwen3_dir: Path,
                                                       names: tuple[str, ...]) -> None:
    """Grammar rows (a JSON schema, greedy and seeded sampled) and a row with
    a reasoning budget draft on CUDA (the tokenizer's small model: head size
    16, the torch reference ops): each verify step's draft-position masks
    go to the device as one bitmask from their own page-locked buffer and
    xgrammar's kernel applies them; drafts the grammar refuses are cut, the
    budget's forced tokens fall where they would, and every request's tokens
    are the plain run's (tests/engine/test_grammar_speculation.py on CUDA)."""
    import json

    from router.text.grammar_vocab import grammar_vocab
    from router.text.model_text import ModelText
    from tests.engine.test_forced_tokens import END_IDS, THINK_END
    from tests.engine.test_grammar import USER

    text = ModelText.load(tiny_qwen3_dir)
    asked = text.encode_prompt(text.render_chat([{"role": "user", "content": "A user, as JSON."}]))
    schema = p.GrammarSpec("json_schema", json.dumps(USER))
    budget = p.ReasoningBudget(budget=7, close_ids=[THINK_END], end_ids=END_IDS,
                               after_ids=prompt(12, 2))
    every = {
        "greedy": (asked, p.SamplingParams(max_tokens=96, temperature=0.0, grammar=schema)),
        "sampled": (asked, p.SamplingParams(max_tokens=96, temperature=1.0, seed=7,
                                            grammar=schema)),
        "budget": (prompt(11, 60), p.SamplingParams(max_tokens=32, temperature=0.0,
                                                    ignore_eos=True, reasoning=budget)),
        "plain": (prompt(13, 80), p.SamplingParams(max_tokens=32, temperature=0.0,
                                                   ignore_eos=True)),
    }
    requests = {name: every[name] for name in names}

    def run(drafter: Drafter | None) -> tuple[dict[str, list[int]], int, int]:
        """Each request's tokens, and the draft tokens verified and accepted."""
        core, events = in_process.make_engine(tiny_qwen3_dir, **{
            "device": "cuda", "dtype": "bfloat16", "page_size": PAGE, "max_concurrency": 4,
            "max_batched_tokens": 256, "kv_capacity_tokens": 4096,
            **({"spec": "ngram", "draft_tokens": 3} if drafter is not None else {})})
        core.handle(grammar_vocab(text))
        if drafter is not None:
            core.scheduler.drafter = drafter
        found: dict[str, list[int]] = {name: [] for name in requests}
        for event in run_to_completion(core, events, requests):
            assert isinstance(event, p.StepOutputs), event
            for output in event.outputs:
                found[output.request_id].extend(output.token_ids)
        if drafter is not None:
            assert core.grammar._draft_host.is_pinned()
        assert core.scheduler.kv.pool.num_used == 0 and core.scheduler.kv.outstanding == 0
        stats = core._stats
        _release(core)
        return found, stats.draft_tokens_total, stats.draft_accepted_tokens_total

    want, _, _ = run(None)
    oracle = OracleDrafter([ids + want[name] for name, (ids, _) in requests.items()])
    got, drafted, accepted = run(oracle)
    if "sampled" in want:
        # Head size 16 runs the torch reference ops and sampler, whose
        # seeded draws follow the request's generator in row order, not the
        # output position as the kernel's do: the sampled row's tokens may
        # differ once it drafts (greedy rows are exact either way).
        assert got.pop("sampled") and want.pop("sampled")
    assert got == want
    if "budget" in want:
        assert want["budget"][7 : 7 + len(END_IDS) + 2] == [*END_IDS, *budget.after_ids]
    # Some drafts were cut (the grammar refused a wrong guess), some rejected.
    assert 0 < accepted < drafted < oracle.proposed


@pytest.mark.parametrize("names", [("bias", "window"), ("openai", "sampled"),
                                   ("processed", "plain")])
def test_bias_penalty_and_logprobs_rows_draft_exactly_on_cuda(qwen3_bf16: Path,
                                                              names: tuple[str, ...]) -> None:
    """Rows with a logit bias, penalties (OpenAI's and a repeat_last_n window)
    and log probabilities (top alternatives, named ids, "processed" mode),
    greedy and seeded sampled, two to a batch: the tokens are
    the plain run's (each draft position biased and penalised with the draft
    tokens before it counted; the kernel keys a seeded row's draws by output
    position), and each token's log probabilities are the plain run's up to
    bf16 rounding (tests/engine/test_speculation_logits.py on CUDA)."""
    tolerance = 5e-2

    def asking(**more: object) -> p.SamplingParams:
        return p.SamplingParams(max_tokens=40, ignore_eos=True, **more)  # type: ignore[arg-type]

    every = {
        "bias": (prompt(13, 90), asking(temperature=0.0, logit_bias={100: 3.0, 200: -2.0},
                                        logprobs=5, logprob_token_ids=[100, 200])),
        "window": (prompt(14, 70), asking(temperature=0.0, repetition_penalty=1.5,
                                          penalty_last_n=6, logprobs=3,
                                          logprobs_mode="processed")),
        "openai": (prompt(15, 110), asking(temperature=0.0, presence_penalty=0.5,
                                           frequency_penalty=0.4, logprobs=0)),
        "sampled": (prompt(16, 80), asking(temperature=0.8, seed=9, frequency_penalty=0.6,
                                           logit_bias={300: 2.0}, logprobs=3)),
        "processed": (prompt(17, 60), asking(temperature=0.9, top_k=40, top_p=0.9, seed=10,
                                             repetition_penalty=1.3, penalty_last_n=16,
                                             logprobs=4, logprobs_mode="processed")),
        "plain": (prompt(18, 100), asking(temperature=0.0)),
    }
    requests = {name: every[name] for name in names}

    def run(drafter: Drafter | None) -> tuple[dict[str, list[int]],
                                              dict[str, list[p.TokenLogprobs]], int]:
        core, events = in_process.make_engine(qwen3_bf16, **{
            "device": "cuda", "dtype": "bfloat16", "page_size": PAGE, "max_concurrency": 8,
            "max_batched_tokens": 256, "kv_capacity_tokens": 4096,
            **({"spec": "ngram", "draft_tokens": 3} if drafter is not None else {})})
        if drafter is not None:
            core.scheduler.drafter = drafter
        tokens: dict[str, list[int]] = {name: [] for name in requests}
        logprobs: dict[str, list[p.TokenLogprobs]] = {name: [] for name in requests}
        for event in run_to_completion(core, events, requests):
            assert isinstance(event, p.StepOutputs), event
            for output in event.outputs:
                tokens[output.request_id].extend(output.token_ids)
                logprobs[output.request_id].extend(output.logprobs)
        assert core.scheduler.kv.pool.num_used == 0 and core.scheduler.kv.outstanding == 0
        accepted = core._stats.draft_accepted_tokens_total
        _release(core)
        return tokens, logprobs, accepted

    want, want_logprobs, _ = run(None)
    oracle = OracleDrafter([ids + want[name] for name, (ids, _) in requests.items()])
    got, got_logprobs, accepted = run(oracle)
    assert got == want
    assert 0 < accepted < oracle.proposed
    for name, (_, params) in requests.items():
        entries, expected = got_logprobs[name], want_logprobs[name]
        assert len(entries) == len(expected) == (len(want[name]) if params.logprobs >= 0 else 0)
        for entry, plain in zip(entries, expected, strict=True):
            assert math.isclose(entry.logprob, plain.logprob, abs_tol=tolerance), name
            for mine, theirs in zip(entry.named_logprobs, plain.named_logprobs, strict=True):
                assert math.isclose(mine, theirs, abs_tol=tolerance), name
            # An alternative may drop out of the top only at its edge (a near tie).
            ours = dict(zip(entry.top_ids, entry.top_logprobs, strict=True))
            for token, value in zip(plain.top_ids, plain.top_logprobs, strict=True):
                if token in ours:
                    assert math.isclose(ours[token], value, abs_tol=tolerance), name
                else:
                    assert value <= min(entry.top_logprobs) + tolerance, name
