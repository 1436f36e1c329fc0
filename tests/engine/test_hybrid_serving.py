"""Hybrid models (Qwen3-Next, Qwen3.5) served by the whole engine on the CPU.

Tiny random checkpoints written by transformers, served in float32 by an
in-process engine with small steps and pages, so prompts span several prefill
chunks (which split the Gated DeltaNet's 64-token chunks) and KV pages. Every
request's greedy tokens must equal transformers' own, whatever else shares
its steps: batching, chunked prefill, preemption, aborts, and prompts that
resume from a recurrent-state checkpoint (engine/kv/state_checkpoints.py).
"""

from __future__ import annotations

import shutil
from array import array
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.engine.test_hybrid_models import FAMILIES, VOCAB, _hf_model
from tests.support.fixtures import QWEN3_TOKENIZER_FILES, qwen3_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE = 8
OPTIONS: dict[str, object] = {"page_size": PAGE, "max_batched_tokens": 40, "max_concurrency": 4,
                              "kv_capacity_tokens": 2048, "dtype": "float32"}
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=FAMILIES)
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(checkpoint directory, transformers' model with its weights)."""
    hf = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory, safe_serialization=True)
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copyfile(qwen3_tokenizer() / name, directory / name)
    return directory, hf


def make_engine(directory: Path, **overrides: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    return in_process.make_engine(directory, **{**OPTIONS, **overrides})


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def greedy(max_tokens: int = NEW_TOKENS, **fields: object) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            **fields)  # type: ignore[arg-type]


def hf_greedy(hf: torch.nn.Module, tokens: list[int], count: int = NEW_TOKENS) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(count):
            logits = hf(torch.tensor([tokens + out]), use_cache=False).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


class Result:
    def __init__(self, outputs: list[p.RequestOutput]) -> None:
        assert outputs and outputs[-1].finish_reason is not None, outputs
        self.tokens = [t for o in outputs for t in o.token_ids]
        self.cached = outputs[-1].num_cached_tokens
        self.reason = outputs[-1].finish_reason


def run_all(core: EngineCore, events: list[p.EngineEvent],
            requests: dict[str, tuple[list[int], p.SamplingParams]]) -> dict[str, Result]:
    outputs = step_outputs(run_to_completion(core, events, requests))
    return {rid: Result([o for o in outputs if o.request_id == rid]) for rid in requests}


def test_batched_requests_with_chunked_prefill_match_transformers(served) -> None:
    directory, hf = served
    core, events = make_engine(directory)
    prompts = {f"r{i}": prompt(10 + i, length) for i, length in enumerate((75, 9, 50, 33))}
    results = run_all(core, events, {rid: (tokens, greedy()) for rid, tokens in prompts.items()})
    for rid, tokens in prompts.items():
        assert results[rid].tokens == hf_greedy(hf, tokens), rid
    # Every chunk of the longest prompt was at most the step budget.
    assert core.scheduler.kv.checkpoints is not None


def test_next_turn_resumes_from_a_checkpoint_and_equals_scratch(served) -> None:
    directory, hf = served
    core, events = make_engine(directory)
    first = prompt(20, 45)
    turn1 = run_all(core, events, {"t1": (first, greedy())})["t1"]
    assert turn1.tokens == hf_greedy(hf, first) and turn1.cached == 0
    # The same prompt again resumes just before its last token (the
    # checkpoint its prefill stopped at for this).
    again = run_all(core, events, {"again": (first, greedy())})["again"]
    assert again.tokens == turn1.tokens and again.cached == len(first) - 1
    # The next turn resumes where the first request stopped.
    second = first + turn1.tokens + prompt(21, 12)
    turn2 = run_all(core, events, {"t2": (second, greedy())})["t2"]
    assert turn2.cached == len(first) + NEW_TOKENS - 1
    assert turn2.tokens == hf_greedy(hf, second)
    counters = core.scheduler.kv.checkpoints.counters  # type: ignore[union-attr]
    assert counters.restored == 2 and counters.restored_tokens == again.cached + turn2.cached


def test_without_checkpoints_cached_prefixes_are_computed_again(served) -> None:
    directory, hf = served
    core, events = make_engine(directory, ctx_checkpoints=0)
    tokens = prompt(30, 40)
    expected = hf_greedy(hf, tokens)
    for rid in ("a", "b"):
        result = run_all(core, events, {rid: (tokens, greedy())})[rid]
        assert result.tokens == expected and result.cached == 0


def test_a_prefix_diverging_inside_a_page_resumes_at_a_checkpoint_within_it(served) -> None:
    """Checkpoints are keyed to the token: a prompt that shares 44 of the
    first request's tokens (not a page boundary) resumes from the checkpoint
    every 20 prompt tokens that lies within them (position 40)."""
    directory, hf = served
    core, events = make_engine(directory, checkpoint_every_n_tokens=20)
    base = prompt(40, 60)
    run_all(core, events, {"base": (base, greedy())})
    branch = base[:44] + prompt(41, 10)
    result = run_all(core, events, {"branch": (branch, greedy())})["branch"]
    assert result.cached == 40
    assert result.tokens == hf_greedy(hf, branch)


def test_preempted_sequences_resume_and_match_transformers(served) -> None:
    directory, hf = served
    # 12 pages of 8 tokens for four requests that grow to 36 + 20 tokens each.
    core, events = make_engine(directory, kv_capacity_tokens=96, output_window=0,
                               max_context=96)
    prompts = {f"p{i}": prompt(50 + i, 36) for i in range(4)}
    results = run_all(core, events, {rid: (tokens, greedy(20)) for rid, tokens in prompts.items()})
    assert core.scheduler.num_preemptions > 0
    for rid, tokens in prompts.items():
        assert results[rid].tokens == hf_greedy(hf, tokens, 20), rid


def test_an_aborted_prefill_leaves_its_lane_clean_for_the_next_request(served) -> None:
    directory, hf = served
    core, events = make_engine(directory)
    core.handle(p.Generate("doomed", prompt(60, 90), greedy()))
    core.step()  # part of its prefill runs, into its lane's state row
    core.handle(p.Abort(["doomed"]))
    tokens = prompt(61, 30)
    result = run_all(core, events, {"next": (tokens, greedy())})["next"]
    assert result.tokens == hf_greedy(hf, tokens)


class OracleDrafter:
    """Proposes each request's known greedy continuation, with every other
    proposal's second guess wrong: drafts accepted whole and drafts cut short."""

    def __init__(self, continuations: list[list[int]]) -> None:
        self.continuations = continuations
        self.calls = 0

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        self.calls += 1
        for full in self.continuations:
            if full[: len(token_ids)] == token_ids:
                draft = full[len(token_ids) : len(token_ids) + limit]
                if self.calls % 2 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % VOCAB
                return draft
        return []


def test_speculative_decoding_gives_the_tokens_of_plain_decoding(served) -> None:
    """Drafts verified in one step: a draft cut short puts the lane's state
    back from its backup row and the kept tokens are computed again, so the
    output is plain decoding's, token for token (and transformers')."""
    directory, hf = served
    prompts = {"long": prompt(80, 35), "short": prompt(81, 12)}
    params = greedy(24)
    expected = {rid: hf_greedy(hf, tokens, 24) for rid, tokens in prompts.items()}
    core, events = make_engine(directory, spec="ngram", draft_tokens=3)
    core.scheduler.drafter = OracleDrafter([prompts[rid] + expected[rid] for rid in prompts])
    got = run_all(core, events, {rid: (t, params) for rid, t in prompts.items()})
    for rid in prompts:
        assert got[rid].tokens == expected[rid], rid
    assert core._stats.draft_accepted_tokens_total > 10
    assert core.scheduler.num_state_rollbacks > 3
    # n-gram drafts on the same requests: the same tokens.
    ngram_core, ngram_events = make_engine(directory, spec="ngram", draft_tokens=3)
    ngram = run_all(ngram_core, ngram_events, {rid: (t, params) for rid, t in prompts.items()})
    assert {rid: result.tokens for rid, result in ngram.items()} == expected
    pools = core.runner.state_pools
    assert pools is not None and pools.backup_row == 4 + 4 * 4 and pools.rows == 2 * 4 + 4 * 4


def test_a_hybrid_draft_model_is_refused(served) -> None:
    directory, _ = served
    with pytest.raises(ValueError, match="must be a plain decoder"):
        make_engine(directory, spec="draft", draft_model=str(directory))


def test_the_kv_pool_holds_only_the_full_attention_layers(served, tmp_path: Path) -> None:
    directory, _ = served
    core, _ = make_engine(directory, host_kv_mib=16, disk_kv_path=str(tmp_path), disk_kv_mib=64)
    config = core.runner.config
    assert len(core.runner.kv_caches) == config.num_attention_layers < config.num_layers
    pools = core.runner.state_pools
    assert pools is not None and pools.rows == 4 + 4 * 4
    # The host tier splits its memory between KV pages and state checkpoints.
    host_kv = core.runner.host_kv
    assert host_kv is not None and pools.host_rows > 0
    assert abs(host_kv.nbytes + pools.host_nbytes - 16 * 2**20) < pools.row_bytes + host_kv.page_bytes
    # The disk tier holds no state: off for this model, said in the log.
    assert core.scheduler.kv.disk is None


def test_checkpoints_moved_to_the_host_tier_resume_prompts(served) -> None:
    """One device checkpoint: the ones it makes room for move to host rows,
    and a later prompt resumes from there (the host tier keeps the pages too)."""
    directory, hf = served
    core, events = make_engine(directory, max_concurrency=1, ctx_checkpoints=1, host_kv_mib=16)
    first, other = prompt(90, 45), prompt(91, 30)
    turn1 = run_all(core, events, {"t1": (first, greedy())})["t1"]
    run_all(core, events, {"other": (other, greedy())})
    counters = core.scheduler.kv.checkpoints.counters  # type: ignore[union-attr]
    assert counters.moved_to_host >= 3
    again = run_all(core, events, {"again": (first, greedy())})["again"]
    assert again.cached == len(first) - 1 and again.tokens == turn1.tokens
    second = first + turn1.tokens + prompt(92, 10)
    turn2 = run_all(core, events, {"t2": (second, greedy())})["t2"]
    assert turn2.cached == len(first) + NEW_TOKENS - 1
    assert turn2.tokens == hf_greedy(hf, second)
    assert counters.restored_from_host == 2
    core.scheduler.check_invariants()


@pytest.mark.parametrize("checkpoints", [0, 2])
def test_the_routers_estimate_counts_pages_and_state_as_the_engine_does(
        served, checkpoints: int) -> None:
    """router/footprint.py plans a hybrid model's KV as the engine allocates
    it: pages of the full-attention layers only, plus a state row per lane
    and per checkpoint (the CPU engine keeps all it is asked for here)."""
    from router.footprint import estimate_footprint, read_shape

    directory, _ = served
    options = p.EngineOptions(max_concurrency=3, max_context=256, ctx_checkpoints=checkpoints)
    estimate = estimate_footprint(read_shape(directory, "hf"), options, cuda=False)
    core, _ = in_process.make_engine(directory, max_concurrency=3, max_context=256,
                                     ctx_checkpoints=checkpoints)
    pools = core.runner.state_pools
    assert pools is not None and pools.rows == 3 * (1 + checkpoints)
    kv_pages = sum(t.numel() * t.element_size() for pair in core.runner.kv_caches for t in pair)
    assert estimate.kv_bytes == kv_pages + pools.nbytes


@pytest.mark.parametrize("weights", ["host", "disk"])
def test_checkpoints_survive_sleep_and_wake(served, weights: str) -> None:
    directory, hf = served
    core, events = make_engine(directory)
    tokens = prompt(70, 30)
    first = run_all(core, events, {"first": (tokens, greedy())})["first"]
    pools = core.runner.state_pools
    assert pools is not None
    before = [t.clone() for t in (*pools.conv, *pools.states)]
    core.handle(p.Sleep(weights=weights))  # type: ignore[arg-type]
    assert pools.conv == [] and pools.states == []
    core.handle(p.Wake())
    for now, saved in zip((*pools.conv, *pools.states), before, strict=True):
        assert torch.equal(now, saved)
    again = run_all(core, events, {"again": (tokens, greedy())})["again"]
    assert again.cached == len(tokens) - 1 and again.tokens == first.tokens == hf_greedy(hf, tokens)


def test_prompt_scores_and_token_logprobs_equal_transformers(served) -> None:
    """Scoring needs every prompt position's logits: no checkpoint resume,
    no early stop of the prefill; chunked over several steps all the same."""
    directory, hf = served
    core, events = make_engine(directory)
    tokens = prompt(100, 60)
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens]), use_cache=False).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    score = p.SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=2)
    for rid in ("s1", "s2"):  # the second finds the prompt's pages cached, and scores anew
        outputs = step_outputs(run_to_completion(core, events, {rid: (tokens, score)}))
        entries = [entry for o in outputs for entry in o.prompt_logprobs]
        assert len(entries) == len(tokens) - 1 and outputs[-1].num_cached_tokens == 0
        for position, entry in enumerate(entries):
            row = expected[position]
            assert abs(entry.logprob - float(row[tokens[position + 1]])) < 1e-4
            assert entry.top_logprobs == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    sampled = p.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = step_outputs(run_to_completion(core, events, {"g": (tokens, sampled)}))
    got = [(t, lp.logprob) for o in outputs for t, lp in zip(o.token_ids, o.logprobs, strict=True)]
    assert got[0][0] == int(expected[-1].argmax())
    assert abs(got[0][1] - float(expected[-1].max())) < 1e-4
    core.scheduler.check_invariants()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_pool_the_hybrid_models_hidden_states(served, pooling: str) -> None:
    directory, hf = served
    core, events = make_engine(directory)
    tokens = prompt(110, 70)  # two 40-token steps
    params = p.SamplingParams(max_tokens=0, pooling=pooling, embd_normalize=-1)  # type: ignore[arg-type]
    outputs = step_outputs(run_to_completion(core, events, {"e": (tokens, params)}))
    (packed,) = [o.embedding for o in outputs if o.embedding]
    vector = array("f", packed).tolist()  # float32 bytes
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([tokens])).last_hidden_state[0].float()
    expected = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    assert torch.allclose(torch.tensor(vector), expected, atol=1e-4, rtol=1e-4)
