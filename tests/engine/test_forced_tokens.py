"""Reasoning budgets and forced tokens (engine/sampling/forced_tokens.py),
in-process with the tiny random Qwen3 and its real tokenizer: the prompt
opened the block (as the router makes it), the random model never closes it
by itself, and the engine writes Qwen3's own "\\n</think>\\n\\n" when the
budget is spent. The pipeline's ordering rules for these rows are checked
over the fake device in tests/engine/test_pipeline.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import protocol as p
from engine.scheduling.core import EngineCore
from router.chat.events import ToolCallEnd
from router.chat.tool_grammar import answer_grammar, forced_tool_grammar
from router.parsers import ToolCallParser
from router.text.model_text import ModelText
from tests.engine.test_grammar import USER, is_user, make_engine, params, prefer, run

THINK_END = 151668  # "</think>", one added token
NEWLINE, TWO_NEWLINES = 198, 271
END_IDS = [NEWLINE, THINK_END, TWO_NEWLINES]  # "\n</think>\n\n", as the template writes it
OPENER = '<tool_call>\n{"name": "'


def budget(tokens: int, end_ids: list[int] = END_IDS, after_ids: list[int] | None = None
           ) -> p.ReasoningBudget:
    return p.ReasoningBudget(budget=tokens, close_ids=[THINK_END], end_ids=end_ids,
                             after_ids=after_ids or [])


@pytest.fixture(scope="module")
def text(tiny_qwen3_dir: Path) -> ModelText:
    return ModelText.load(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path, text: ModelText) -> tuple[EngineCore, list[p.EngineEvent]]:
    from router.text.grammar_vocab import grammar_vocab

    core, events = make_engine(tiny_qwen3_dir)
    core.handle(grammar_vocab(text))
    return core, events


def thinking_prompt(text: ModelText, question: str) -> list[int]:
    """A chat prompt whose assistant turn starts inside <think>, as the router
    opens it when a budget applies."""
    rendered = text.render_chat([{"role": "user", "content": question}], enable_thinking=True)
    return text.encode_prompt(rendered + "<think>\n")


def test_a_spent_budget_forces_the_closing_and_the_model_answers_after_it(
        engine: tuple[EngineCore, list[p.EngineEvent]], text: ModelText) -> None:
    core, events = engine
    prompt = thinking_prompt(text, "Why is the sky blue?")
    other = thinking_prompt(text, "Name three rivers.")
    free = run(core, events, {"free": (prompt, params(max_tokens=24))})["free"].tokens
    alone = run(core, events, {"other": (other, params(max_tokens=24))})["other"].tokens
    assert THINK_END not in free  # the random model never closes the block itself
    got = run(core, events, {
        "budget": (prompt, params(max_tokens=24, reasoning=budget(8))),
        "other": (other, params(max_tokens=24)),
        "sampled": (prompt, params(max_tokens=16, temperature=0.9, seed=5, reasoning=budget(5))),
    })
    tokens = got["budget"].tokens
    # The model's own greedy tokens up to the budget, then the closing.
    assert tokens[:8] == free[:8]
    assert tokens[8:11] == END_IDS
    assert got["budget"].finish_reason == "length" and len(tokens) == 24
    # After it, the model goes on from the closing as from any text.
    after = run(core, events, {"after": (prompt + tokens[:11], params(max_tokens=13))})["after"]
    assert tokens[11:] == after.tokens
    assert got["other"].tokens == alone  # a row beside it is untouched
    assert got["sampled"].tokens[5:8] == END_IDS  # drawn rows are forced alike
    assert len(core.forced) == 0, "every finished request drops its plan"


def test_a_block_the_model_closes_itself_gets_nothing_forced(
        engine: tuple[EngineCore, list[p.EngineEvent]], text: ModelText,
        monkeypatch: pytest.MonkeyPatch) -> None:
    core, events = engine
    prompt = thinking_prompt(text, "Is 7 prime?")
    # The model closes its block with its fourth token, well within the budget.
    prefer(core, monkeypatch, [THINK_END], after=3, steps=1)
    closed = run(core, events, {"own": (prompt, params(max_tokens=20, reasoning=budget(6)))})["own"]
    assert closed.tokens[3] == THINK_END
    prefer(core, monkeypatch, [THINK_END], after=3, steps=1)
    unbudgeted = run(core, events, {"free": (prompt, params(max_tokens=20))})["free"]
    assert closed.tokens == unbudgeted.tokens
    assert closed.tokens.count(THINK_END) == 1


def test_a_forced_token_outvotes_a_ban(engine: tuple[EngineCore, list[p.EngineEvent]],
                                       text: ModelText) -> None:
    core, events = engine
    prompt = thinking_prompt(text, "Count to three.")
    settings = params(max_tokens=10, logit_bias={THINK_END: float("-inf")}, reasoning=budget(4))
    tokens = run(core, events, {"banned": (prompt, settings)})["banned"].tokens
    assert tokens[4:7] == END_IDS


def test_a_json_answer_follows_a_spent_budget_under_its_grammar(
        engine: tuple[EngineCore, list[p.EngineEvent]], text: ModelText) -> None:
    core, events = engine
    prompt = thinking_prompt(text, "A user, as JSON.")
    grammar = answer_grammar(p.GrammarSpec("json_schema", json.dumps(USER)), "inside")
    # The grammar lets no newline follow </think>: the closing is "\n</think>".
    settings = params(max_tokens=200, grammar=grammar, reasoning=budget(6, END_IDS[:2]))
    result = run(core, events, {"json": (prompt, settings)})["json"]
    assert result.error is None and result.finish_reason == "stop"
    assert result.tokens[6:8] == END_IDS[:2]
    answer = text.tokenizer.decode(result.tokens[8:], skip_special_tokens=True)
    assert is_user(json.loads(answer)), answer


def test_a_forced_call_opens_with_forced_tokens_after_the_budget(
        engine: tuple[EngineCore, list[p.EngineEvent]], text: ModelText) -> None:
    core, events = engine
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}}
    prompt = thinking_prompt(text, "Weather in Paris?")
    grammar = forced_tool_grammar("hermes", [tool], only=None, parallel=False, thinking="inside")
    opener = text.tokenizer.encode(OPENER)
    settings = params(max_tokens=120, grammar=grammar,
                      reasoning=budget(5, END_IDS[:2], after_ids=opener))
    result = run(core, events, {"call": (prompt, settings)})["call"]
    assert result.error is None and result.finish_reason == "stop"
    assert result.tokens[5:7 + len(opener)] == [*END_IDS[:2], *opener]
    reply = text.tokenizer.decode(result.tokens[7:], skip_special_tokens=True)
    parser = ToolCallParser("hermes", [tool])
    calls = [e for e in [*parser.feed(reply), *parser.flush()] if isinstance(e, ToolCallEnd)]
    assert [call.name for call in calls] == ["get_weather"]
