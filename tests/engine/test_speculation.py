"""Speculative decoding with n-gram drafts (engine/sampling/drafter.py and
verify.py): the drafter and the acceptance rule alone, then whole engines on
real weights, whose greedy output must not change by a token."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

import protocol as p
from engine.sampling.drafter import NgramDrafter, may_draft
from engine.sampling.verify import accept_drafts
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion

SPEC = {"spec": "ngram", "draft_tokens": 4}

# A prompt whose answer copies from it, so n-gram drafts get accepted.
PASSAGE = ("The roundhouse stood at the end of the line. Every evening the engines came "
           "home, one after another, and the turntable brought each to its stall.")
COPY = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n{PASSAGE}"}]


def greedy(max_tokens: int = 40, **more: object) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, **more)  # type: ignore[arg-type]


def engine(model: Path, **options: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    # Every engine here reads the same weights: each checkpoint is read once.
    return in_process.make_engine_sharing_weights(model, **{**SMALL_STEPS, **options})


def run(core: EngineCore, events: list[p.EngineEvent],
        requests: dict[str, tuple[list[int], p.SamplingParams]]
        ) -> dict[str, tuple[list[int], str | None]]:
    found: dict[str, tuple[list[int], str | None]] = {name: ([], None) for name in requests}
    for event in run_to_completion(core, events, requests):
        assert isinstance(event, p.StepOutputs), event
        for output in event.outputs:
            tokens, reason = found[output.request_id]
            assert reason is None, "output after the finish"
            found[output.request_id] = (tokens + output.token_ids, output.finish_reason)
    return found


def accepted(core: EngineCore) -> int:
    return core._stats.draft_accepted_tokens_total


def assert_no_pages_held(core: EngineCore) -> None:
    """Idle: every page is free or cached, none held by a sequence."""
    pool = core.scheduler.kv.pool
    core.scheduler.check_invariants()
    assert pool.num_used == 0 and pool.num_free == pool.num_pages  # (cached pages count as free)
    assert core.scheduler.kv.outstanding == 0


def chat_prompt(model: Path, messages: list[dict[str, str]]) -> list[int]:
    from router.text.model_text import ModelText

    text = ModelText.load(model)
    return text.encode_prompt(text.render_chat(messages))


# ---- the drafter and the rule --------------------------------------------------


def test_ngram_drafter_proposes_what_followed_the_longest_most_recent_match() -> None:
    drafter = NgramDrafter(1, 3)
    # "7 8 9" occurs at 1 and 6; the most recent earlier match continues "4 5".
    tokens = [0, 7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 3, 7, 8, 9]
    assert drafter.propose(tokens, 2) == [4, 5]
    assert drafter.propose(tokens, 10) == [4, 5, 6, 3, 7, 8, 9]
    # Only a 1-gram matches: "8" after the final "3 8"... the latest 8 is followed by 9.
    assert drafter.propose([1, 8, 9, 2, 3, 8], 3) == [9, 2, 3]
    assert drafter.propose([1, 2, 3], 4) == []  # nothing repeats
    assert NgramDrafter(2, 3).propose([5, 1, 2, 5], 4) == []  # a 1-gram is too short
    assert drafter.propose([5, 5], 3) == [5]  # the suffix itself is never the match
    assert drafter.propose(tokens, 0) == []
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramDrafter(3, 2)


def test_only_rows_with_unchanged_logits_draft() -> None:
    assert may_draft(greedy(stop_token_ids=[2]))
    # Sampled rows too (tests/engine/test_speculative_sampling.py).
    assert may_draft(p.SamplingParams(max_tokens=5, temperature=0.7))
    # Grammar and reasoning-budget rows too (tests/engine/test_grammar_speculation.py).
    assert may_draft(greedy(grammar=p.GrammarSpec("json_schema", "{}")))
    assert may_draft(greedy(reasoning=p.ReasoningBudget(budget=5, close_ids=[3], end_ids=[3])))
    # Bias, penalty and logprobs rows too (tests/engine/test_speculation_logits.py).
    assert may_draft(greedy(logprobs=0, logit_bias={3: 1.0}, repetition_penalty=1.1))
    for changed in ({"prompt_logprobs": 0},):
        assert not may_draft(msgspec.structs.replace(greedy(), **changed)), changed


def test_greedy_acceptance_keeps_the_matching_prefix_and_one_more() -> None:
    assert accept_drafts(5, [5, 6, 7], [6, 9, 8]) == [5, 6, 9]  # 7 rejected: 9 instead
    assert accept_drafts(5, [5, 6], [6, 1]) == [5, 6, 1]  # all accepted, 1 free
    assert accept_drafts(4, [5, 6], [6, 1]) == [4]  # the first guess is wrong
    assert accept_drafts(4, [], []) == [4]


# ---- whole engines -------------------------------------------------------------------


def test_smollm2_copying_is_exact_and_accepts_drafts(smollm2_gguf: Path) -> None:
    prompt = chat_prompt(smollm2_gguf, COPY)
    plain_core, plain_events = engine(smollm2_gguf)
    want = run(plain_core, plain_events, {"a": (prompt, greedy(48))})["a"]
    core, events = engine(smollm2_gguf, **SPEC)
    got = run(core, events, {"a": (prompt, greedy(48))})["a"]
    assert got == want
    assert accepted(core) > 10, core._stats
    # Fewer steps than tokens: several tokens came out of single steps.
    outputs = in_process.step_outputs(events)
    assert max(len(output.token_ids) for output in outputs) > 1
    assert sum(output.num_draft_accepted for output in outputs) == accepted(core)
    assert_no_pages_held(core)


def test_smollm2_max_tokens_and_stop_tokens_cut_inside_drafts(smollm2_gguf: Path) -> None:
    prompt = chat_prompt(smollm2_gguf, COPY)
    plain_core, plain_events = engine(smollm2_gguf)
    full, _ = run(plain_core, plain_events, {"a": (prompt, greedy(40))})["a"]
    core, events = engine(smollm2_gguf, **SPEC)
    # Every length ends exactly there, wherever the draft windows fall.
    requests = {f"n{n}": (prompt, greedy(n)) for n in range(1, 13)}
    for name, (tokens, reason) in run(core, events, requests).items():
        n = int(name[1:])
        assert (tokens, reason) == (full[:n], "length"), name
    # A stop token (as the router sends end-of-sequence ids) met inside an
    # accepted draft ends the request there; what the draft had after it is dropped.
    before = accepted(core)
    for index in (12, 20, 31):
        stop = full[index]
        first = full.index(stop)
        got = run(core, events, {"s": (prompt, greedy(40, stop_token_ids=[stop]))})["s"]
        assert got == (full[: first + 1], "stop"), index
    assert accepted(core) > before
    assert_no_pages_held(core)


def test_qwen3_mixed_batch_is_unchanged_by_speculation(tiny_qwen3_dir: Path) -> None:
    prompt = chat_prompt(tiny_qwen3_dir, COPY)
    other = chat_prompt(tiny_qwen3_dir, [{"role": "user", "content": "Count: 1 2 3 1 2 3 1 2"}])
    batch = {
        "copy": (prompt, greedy(30)),
        "other": (other, greedy(25, ignore_eos=True)),
        "short": (prompt[:20], greedy(17)),
        "sampled": (other, p.SamplingParams(max_tokens=20, temperature=0.8, seed=5)),
        "penalised": (prompt, greedy(20, presence_penalty=0.5)),
        "grammar": (other, greedy(30, grammar=p.GrammarSpec(
            "json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}}'))),
    }
    from router.text.grammar_vocab import grammar_vocab
    from router.text.model_text import ModelText

    vocab = grammar_vocab(ModelText.load(tiny_qwen3_dir))
    plain_core, plain_events = engine(tiny_qwen3_dir)
    core, events = engine(tiny_qwen3_dir, **SPEC)
    plain_core.handle(vocab)
    core.handle(vocab)
    for size in (1, 2, 6):
        chosen = dict(list(batch.items())[:size])
        got, want = run(core, events, chosen), run(plain_core, plain_events, chosen)
        # The sampled row drafts too: its draws differ, its length does not.
        if "sampled" in chosen:
            assert len(got.pop("sampled")[0]) == len(want.pop("sampled")[0])
        assert got == want, size
    assert core._stats.draft_tokens_total > 0
    assert_no_pages_held(core)


def test_qwen3_preemption_under_speculation_stays_exact(tiny_qwen3_dir: Path) -> None:
    prompt = chat_prompt(tiny_qwen3_dir, COPY)
    small = {"kv_capacity_tokens": 96, "output_window": 0, "max_context": 96}
    batch = {f"r{i}": (prompt[i : i + 37], greedy(40)) for i in range(3)}
    plain_core, plain_events = engine(tiny_qwen3_dir, **small)
    core, events = engine(tiny_qwen3_dir, **small, **SPEC)
    assert run(core, events, batch) == run(plain_core, plain_events, batch)
    assert core.scheduler.num_preemptions > 0
    assert_no_pages_held(core)
