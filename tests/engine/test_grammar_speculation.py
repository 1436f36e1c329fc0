"""Speculative decoding of grammar rows and of rows with a reasoning budget
(engine/sampling/grammar.py cut_draft and fill_drafts, forced_tokens.py
cut_draft): drafts are cut where the grammar refuses them or a forced token
would fall, each draft position is masked with the grammar's state after
the draft tokens before it, and the tokens are exactly those without
speculation. SmolLM2's real weights copy a JSON object from the prompt, so
n-gram drafts are accepted."""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.sampling.grammar import EngineGrammar
from engine.scheduling.core import EngineCore
from engine.scheduling.sequence import Sequence
from router.text.grammar_vocab import grammar_vocab
from router.text.model_text import ModelText
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS
from tests.engine.test_speculation import run as run_requests

SPEC = {"spec": "ngram", "draft_tokens": 4}
VOCAB_SIZE = 49152  # SmolLM2's logits rows
EOS = 2  # <|im_end|>, the router's end-of-sequence id and the grammars' stop token
IM_START = 1  # a special token no grammar takes
XYZ = 33300  # "xyz": fine inside a JSON string, refused anywhere else

RECORD = {"name": "Ada Lovelace", "city": "London", "year": 1815,
          "languages": ["English", "French"]}
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "city", "year", "languages"],
          "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                         "year": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string"}}}}
JSON_SCHEMA = p.GrammarSpec("json_schema", json.dumps(SCHEMA))
COPY = [{"role": "user", "content": f"Copy this JSON object exactly:\n{json.dumps(RECORD)}"}]
PASSAGE = [{"role": "user", "content": "Repeat this text exactly, word for word:\nThe roundhouse "
            "stood at the end of the line. Every evening the engines came home."}]


@pytest.fixture(scope="module")
def text(smollm2_gguf: Path) -> ModelText:
    return ModelText.load(smollm2_gguf)


@pytest.fixture(scope="module")
def vocab(text: ModelText) -> p.GrammarVocab:
    return grammar_vocab(text)


@pytest.fixture(scope="module")
def copy_prompt(text: ModelText) -> list[int]:
    return text.encode_prompt(text.render_chat(COPY))


def make_engine(model: Path, vocab: p.GrammarVocab, **options: object
                ) -> tuple[EngineCore, list[p.EngineEvent]]:
    core, events = in_process.make_engine_sharing_weights(model, **{**SMALL_STEPS, **options})
    core.handle(vocab)
    return core, events


@pytest.fixture(scope="module")
def plain(smollm2_gguf: Path, vocab: p.GrammarVocab) -> tuple[EngineCore, list[p.EngineEvent]]:
    return make_engine(smollm2_gguf, vocab)


@pytest.fixture
def speculative(smollm2_gguf: Path, vocab: p.GrammarVocab
                ) -> tuple[EngineCore, list[p.EngineEvent]]:
    return make_engine(smollm2_gguf, vocab, **SPEC)


def greedy(max_tokens: int = 64, **more: object) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, **more)  # type: ignore[arg-type]


def run(engine: tuple[EngineCore, list[p.EngineEvent]],
        requests: dict[str, tuple[list[int], p.SamplingParams]]
        ) -> dict[str, tuple[list[int], str | None]]:
    """Each request's tokens and finish reason; a request error fails the test."""
    return run_requests(*engine, requests)


def parsed(text: ModelText, tokens: list[int]) -> object:
    return json.loads(text.tokenizer.decode([t for t in tokens if t != EOS]))


def assert_no_pages_held(core: EngineCore) -> None:
    core.scheduler.check_invariants()
    pool = core.scheduler.kv.pool
    assert pool.num_used == 0 and core.scheduler.kv.outstanding == 0


class ScriptedDrafter:
    """Proposes what a known run wrote next (each prompt followed by its plain
    tokens), with the tokens named in `wrong` replaced."""

    def __init__(self, runs: list[list[int]], wrong: dict[int, int]) -> None:
        self.runs = runs
        self.wrong = wrong
        self.proposed = 0

    def propose(self, token_ids: Seq[int], max_tokens: int) -> list[int]:
        known = list(token_ids)
        for run_ids in self.runs:
            if run_ids[: len(known)] == known:
                draft = [self.wrong.get(token, token)
                         for token in run_ids[len(known) : len(known) + max_tokens]]
                self.proposed += len(draft)
                return draft
        return []


# ---- the matcher's side, without a model -------------------------------------------------


@pytest.fixture
def grammar(vocab: p.GrammarVocab) -> EngineGrammar:
    engine_grammar = EngineGrammar(VOCAB_SIZE, torch.device("cpu"))
    engine_grammar.set_vocab(vocab)
    return engine_grammar


def admitted(grammar: EngineGrammar, request_id: str, spec: p.GrammarSpec) -> Sequence:
    grammar.admit(request_id, spec)
    return Sequence(request_id, [5, 6, 7], greedy(grammar=spec))


def plain_masks(grammar: EngineGrammar, seq: Sequence, tokens: list[int]) -> list[torch.Tensor]:
    """The masks a row without drafts would get after each of tokens, taken
    for real and then undone (the matcher is left as it was)."""
    matcher = grammar._matchers[seq.request_id]
    masks = []
    for token in tokens:
        assert matcher.accept_token(token)
        host = torch.zeros((1, (VOCAB_SIZE + 31) // 32), dtype=torch.int32)
        matcher.fill_next_token_bitmask(host, 0)
        masks.append(host[0].clone())
    matcher.rollback(len(tokens))
    return masks


def test_drafts_are_cut_before_a_refused_or_ending_token(grammar: EngineGrammar,
                                                         text: ModelText) -> None:
    seq = admitted(grammar, "a", JSON_SCHEMA)
    opening = text.tokenizer.encode('{"name": "Ada')
    before = grammar.fill([seq])
    assert before is not None
    # "xyz" after the opening quote of a string is text; after "name" it is refused.
    assert grammar.cut_draft(seq, [*opening, XYZ, 28]) == [*opening, XYZ, 28]
    name_key = text.tokenizer.encode('{"name"')
    assert grammar.cut_draft(seq, [*name_key, XYZ, *opening]) == name_key
    assert grammar.cut_draft(seq, [XYZ, *opening]) == []
    assert grammar.cut_draft(seq, [*name_key, IM_START]) == name_key  # no grammar takes it
    # A grammar that ends: its stop token never goes into a draft.
    digits = admitted(grammar, "d", p.GrammarSpec("regex", "[0-9]+"))
    one_eight = text.tokenizer.encode("18")
    assert grammar.cut_draft(digits, [*one_eight, EOS, *one_eight]) == one_eight
    # Trying drafts leaves the matchers where they were.
    after = grammar.fill([seq, digits])
    assert after is not None and torch.equal(after.bitmask[0], before.bitmask[0])
    verdict = grammar.accept([seq, digits], [opening[0], EOS])
    assert "d" in verdict.rejected and not verdict.completed  # "18" was never kept


def test_each_draft_position_gets_the_mask_after_the_drafts_before_it(
        grammar: EngineGrammar, text: ModelText) -> None:
    first = admitted(grammar, "a", JSON_SCHEMA)
    second = admitted(grammar, "b", p.GrammarSpec("regex", "[0-9]+"))
    free = Sequence("free", [5, 6], greedy())
    draft_a = text.tokenizer.encode('{"name": "A')
    draft_b = text.tokenizer.encode("1815")
    assert grammar.cut_draft(first, draft_a) == draft_a
    drafted = [(first, draft_a), (free, [9, 9]), (second, draft_b)]
    mask = grammar.fill_drafts(drafted)
    assert mask is not None
    a_rows = range(len(draft_a))
    b_rows = range(len(draft_a) + 2, len(draft_a) + 2 + len(draft_b))
    assert mask.rows == [*a_rows, *b_rows]  # the plain row's two rows stay unmasked
    want = plain_masks(grammar, first, draft_a) + plain_masks(grammar, second, draft_b)
    for row, expected in zip([*a_rows, *b_rows], want, strict=True):
        assert torch.equal(mask.bitmask[row], expected), row
    # Rolled back: the matchers take the real tokens from their real state.
    verdict = grammar.accept([first, second], [draft_a[0], draft_b[0]],
                             {"a": draft_a[1:], "b": [*draft_b[1:], EOS]})
    assert verdict.rejected == {} and verdict.completed == {"b"}
    # The window a lane's worth of draft rows gets, renumbered.
    window = mask.window(len(draft_a), 4)
    assert window is not None and window.rows == [2, 3]
    assert torch.equal(window.bitmask[2], mask.bitmask[b_rows[0]])


def test_a_draft_position_the_grammar_allows_nothing_after_fails_only_if_emitted() -> None:
    """As a plain step's fill() does: the row is left unmasked, and the
    request fails if the token drawn there is one the step emits."""
    tokens = [""] * 100
    tokens[64] = "a"  # a raw vocabulary that spells "a" and nothing else
    grammar = EngineGrammar(100, torch.device("cpu"))
    grammar.set_vocab(p.GrammarVocab(tokens, "raw", [99]))
    spec = p.GrammarSpec("ebnf", 'root ::= "a" "c"')  # after "a", a "c" no token gives
    kept, failed = admitted(grammar, "kept", spec), admitted(grammar, "failed", spec)
    assert grammar.cut_draft(kept, [64, 64]) == [64]
    assert grammar.fill_drafts([(kept, [64]), (failed, [64])]) is None  # nothing to mask
    # "kept": its draft was rejected, so only its sampled "a" is emitted.
    verdict = grammar.accept([kept, failed], [64, 64], {"failed": [7]})
    assert list(verdict.rejected) == ["failed"] and "allows no token" in verdict.rejected["failed"]
    assert grammar.fill([kept]) is None  # "kept" took its "a": now stuck in a plain step


# ---- whole engines on SmolLM2 ------------------------------------------------------------


def test_json_schema_copy_is_exact_and_accepts_drafts(smollm2_gguf, vocab, plain, text,
                                                      copy_prompt) -> None:
    ended_in_a_verify_step = []
    # With the end-of-sequence id as a stop token (as the router sends it),
    # and without (ignore_eos): then only the grammar's end stops the row.
    # The plain answers do not depend on the draft length: run once each.
    requests = {tuple(stops): {"json": (copy_prompt, greedy(stop_token_ids=stops, grammar=JSON_SCHEMA))}
                for stops in ([EOS], [])}
    plain_answers = {stops: run(plain, request)["json"] for stops, request in requests.items()}
    for draft_tokens in (3, 4):  # the draft windows fall differently
        core, events = engine = make_engine(smollm2_gguf, vocab, spec="ngram",
                                            draft_tokens=draft_tokens)
        for stops in ([EOS], []):
            want = plain_answers[tuple(stops)]
            got = run(engine, requests[tuple(stops)])["json"]
            assert got == want, (draft_tokens, stops)
            assert got[1] == "stop" and got[0][-1] == EOS and parsed(text, got[0]) == RECORD
            outputs = in_process.step_outputs(events)
            assert max(len(output.token_ids) for output in outputs) > 1
            if outputs[-1].num_draft_tokens:
                ended_in_a_verify_step.append(stops)
        assert core._stats.draft_accepted_tokens_total > 20, core._stats
        assert_no_pages_held(core)
    # The grammar completed with the free token of a verify step, and that
    # ended the row with no stop token to do it.
    assert [] in ended_in_a_verify_step


def test_drafts_the_grammar_or_the_target_refuses_leave_the_tokens_exact(
        plain, speculative, text, copy_prompt) -> None:
    """A draft holds, in place of the real tokens, an IM_START (refused by the
    grammar everywhere: the draft is cut before it) or an "xyz" inside a
    string value (allowed by the grammar, rejected by the target): after that
    rejected tail the matcher must be back at the real state, or the next
    tokens would differ or fail."""
    request = {"json": (copy_prompt, greedy(grammar=JSON_SCHEMA))}
    want = run(plain, request)["json"]
    tokens = text.tokenizer.encode
    in_strings = [tokens(" Lovelace")[1], tokens("London")[0]]  # "vel" and "London"
    between_values = [tokens(",")[0], tokens(' ["')[0]]
    assert all(token in want[0] for token in [*in_strings, *between_values])
    core, _ = speculative
    drafter = ScriptedDrafter([copy_prompt + want[0]], {
        **dict.fromkeys(in_strings, XYZ), **dict.fromkeys(between_values, IM_START)})
    core.scheduler.drafter = drafter
    assert run(speculative, request)["json"] == want
    stats = core._stats
    assert stats.draft_tokens_total < drafter.proposed  # cut where the grammar refuses
    assert 0 < stats.draft_accepted_tokens_total < stats.draft_tokens_total  # "xyz" rejected
    assert_no_pages_held(core)


def test_draft_positions_are_masked(plain, speculative, text, copy_prompt,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The model would rather say IM_START, which no grammar allows, than
    anything else: the plain run never does (its mask removes it), and a
    verify step must mask every draft position as the plain run masks that
    position, or its targets there would be IM_START."""
    request = {"json": (copy_prompt, greedy(grammar=JSON_SCHEMA))}
    for core, _ in (plain, speculative):
        compute_logits = core.runner.model.compute_logits

        def favour_im_start(hidden: torch.Tensor, compute=compute_logits) -> torch.Tensor:
            logits = compute(hidden)
            logits[:, IM_START] = logits.max() + 100.0
            return logits

        monkeypatch.setattr(core.runner.model, "compute_logits", favour_im_start)
    want = run(plain, request)["json"]
    assert parsed(text, want[0]) == RECORD
    assert run(speculative, request)["json"] == want
    assert speculative[0]._stats.draft_accepted_tokens_total > 10


def test_mixed_batches_of_grammar_and_plain_rows_are_unchanged(plain, speculative, text,
                                                               copy_prompt) -> None:
    passage = text.encode_prompt(text.render_chat(PASSAGE))
    batch = {
        "json": (copy_prompt, greedy(grammar=JSON_SCHEMA)),
        "plain": (passage, greedy(40)),
        "object": (copy_prompt, greedy(48, grammar=p.GrammarSpec("json_object", ""))),
        "regex": (passage, greedy(30, grammar=p.GrammarSpec("regex", "The [a-z ]+\\."))),
        # A grammar row that asks for log probabilities too.
        "scored": (copy_prompt, greedy(30, grammar=JSON_SCHEMA, logprobs=0)),
        "copy": (copy_prompt, greedy(40)),
    }
    got, want = run(speculative, batch), run(plain, batch)
    assert got == want
    assert parsed(text, got["json"][0]) == RECORD
    core, events = speculative
    drafted = {output.request_id for output in in_process.step_outputs(events)
               if output.num_draft_accepted}
    assert {"json", "object", "regex", "plain"} <= drafted, drafted
    assert_no_pages_held(core)


def test_reasoning_budgets_draft_up_to_their_forced_tokens(plain, speculative, text,
                                                           copy_prompt) -> None:
    """Forced tokens land where they would without drafts: after a spent
    budget (end_ids then after_ids), and after the model's own close of the
    block (after_ids), which here comes inside copied, drafted text."""
    tokens = text.tokenizer.encode
    city = tokens('"city"')[1]  # the middle of the key: "city" without its quotes
    budgets = {
        "spent": p.ReasoningBudget(budget=9, close_ids=[IM_START], end_ids=tokens(" END"),
                                   after_ids=tokens(" AFTER")),
        "closed": p.ReasoningBudget(budget=-1, close_ids=[city], after_ids=tokens(" AFTER")),
    }
    requests = {name: (copy_prompt, greedy(40, reasoning=budget))
                for name, budget in budgets.items()}
    want = run(plain, requests)
    assert run(speculative, requests) == want
    spent, closed = want["spent"][0], want["closed"][0]
    assert spent[9:12] == [*tokens(" END"), *tokens(" AFTER")]
    at = closed.index(city)
    assert closed[at + 1 : at + 3] == tokens(" AFTER")
    core, events = speculative
    accepted = {output.request_id: 0 for output in in_process.step_outputs(events)}
    for output in in_process.step_outputs(events):
        accepted[output.request_id] += output.num_draft_accepted
    assert accepted["spent"] > 0 and accepted["closed"] > 0, accepted
    assert_no_pages_held(core)
