"""Thinking budgets in the router (router/chat/thinking_budget.py): where a
turn's budget comes from, how the prompt and the thinking switch follow it,
and what the engine is asked to force, with the real Qwen3 template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol import GrammarSpec, ReasoningBudget
from router.chat.request import ChatRequest, NamedTool
from router.chat.thinking_budget import ThinkingBudget, effort_budget, given_budget
from router.chat.turn import PreparedTurn, _reasoning
from router.errors import InvalidRequest
from router.text.model_text import ModelText
from tests.router.chat.test_turn import HI, TOOL, TextOnly, prepare

THINK_END = 151668
END = [198, THINK_END, 271]  # "\n</think>\n\n"
JSON_ANSWER = GrammarSpec("json_schema", json.dumps({"type": "object"}))


@pytest.fixture(scope="module")
def manager(qwen3_tokenizer_dir: Path) -> TextOnly:
    return TextOnly(ModelText.load(qwen3_tokenizer_dir))


def engine_budget(prepared: PreparedTurn, max_tokens: int = 4000,
                  under_grammar: bool = False) -> ReasoningBudget | None:
    return _reasoning(prepared, max_tokens, under_grammar)


def test_counts_and_effort_levels() -> None:
    assert given_budget(None, "thinking_budget") is None
    assert given_budget(512, "thinking_budget") == ThinkingBudget(512)
    assert given_budget(-1, "thinking_budget") == ThinkingBudget(-1)
    for bad in (-2, 1.5, True, "100"):
        with pytest.raises(InvalidRequest) as caught:
            given_budget(bad, "thinking_budget")
        assert caught.value.param == "thinking_budget"
    levels = {effort: effort_budget(effort) for effort in
              ("none", "minimal", "low", "medium", "high", "xhigh", "max")}
    assert {effort: b.tokens for effort, b in levels.items() if b is not None} == {
        "none": 0, "minimal": 0, "low": 1024, "medium": 8192, "high": 24576, "xhigh": -1, "max": -1}
    assert effort_budget(None) is None
    # A level is a default: it leaves the answer a quarter of the output.
    assert ThinkingBudget(8192, default=True).for_output(1000) == 750
    assert ThinkingBudget(8192).for_output(1000) == 8192  # a client's count is its own


def test_a_budget_opens_the_block_in_the_prompt_and_the_engine_holds_it(manager: TextOnly) -> None:
    free = prepare(manager, ChatRequest(HI))
    assert free.thinking == "open" and engine_budget(free) is None  # nothing asked: the model is free
    held = prepare(manager, ChatRequest(HI, thinking_budget=ThinkingBudget(300)))
    assert held.thinking == "inside" and held.prompt == free.prompt + "<think>\n"
    assert engine_budget(held) == ReasoningBudget(budget=300, close_ids=[THINK_END], end_ids=END)
    # Under a grammar nothing may follow </think> but the answer.
    assert engine_budget(held, under_grammar=True).end_ids == END[:2]  # type: ignore[union-attr]
    unlimited = prepare(manager, ChatRequest(HI, thinking_budget=ThinkingBudget(-1)))
    assert unlimited.thinking == "open" and engine_budget(unlimited) is None


def test_a_budget_of_zero_turns_thinking_off(manager: TextOnly) -> None:
    off = prepare(manager, ChatRequest(HI, thinking_budget=ThinkingBudget(0)))
    assert off.thinking == "off" and off.prompt.endswith("<think>\n\n</think>\n\n")
    assert engine_budget(off) is None
    # An explicit switch wins: the engine then closes the block at once.
    forced_open = prepare(manager, ChatRequest(HI, enable_thinking=True, thinking_budget=ThinkingBudget(0)))
    assert engine_budget(forced_open).budget == 0  # type: ignore[union-attr]


def test_the_servers_budget_applies_when_the_request_names_none(manager: TextOnly) -> None:
    default = prepare(manager, ChatRequest(HI), reasoning_budget=2000)
    assert default.thinking == "inside"
    assert engine_budget(default, max_tokens=1000).budget == 750  # type: ignore[union-attr]
    assert engine_budget(default, max_tokens=9000).budget == 2000  # type: ignore[union-attr]
    own = prepare(manager, ChatRequest(HI, thinking_budget=ThinkingBudget(5000)), reasoning_budget=2000)
    assert engine_budget(own, max_tokens=1000).budget == 5000  # type: ignore[union-attr]
    assert prepare(manager, ChatRequest(HI), reasoning_budget=0).thinking == "off"


def test_a_json_answer_defaults_to_thinking_off(manager: TextOnly, qwen3_tokenizer_dir: Path) -> None:
    json_off = prepare(manager, ChatRequest(HI, response_format=JSON_ANSWER))
    assert json_off.thinking == "off" and json_off.prompt.endswith("</think>\n\n")
    assert prepare(manager, ChatRequest(HI, response_format=GrammarSpec("json_object"))).thinking == "off"
    # Any reasoning setting of the request keeps thinking as it says.
    assert prepare(manager, ChatRequest(HI, response_format=JSON_ANSWER, enable_thinking=True)).thinking == "open"
    budgeted = prepare(manager, ChatRequest(HI, response_format=JSON_ANSWER,
                                            thinking_budget=ThinkingBudget(64)))
    assert budgeted.thinking == "inside"
    assert engine_budget(budgeted, under_grammar=True).budget == 64  # type: ignore[union-attr]
    # Not other answer formats, and not the server's own default budget.
    assert prepare(manager, ChatRequest(HI, response_format=GrammarSpec("regex", "a+"))).thinking == "open"
    assert prepare(manager, ChatRequest(HI, response_format=JSON_ANSWER),
                   reasoning_budget=500).thinking == "off"
    # The server's --chat-template-kwargs enable_thinking is the operator's setting.
    thinking = TextOnly(ModelText.load(qwen3_tokenizer_dir).with_overrides(None, {"enable_thinking": True}))
    assert prepare(thinking, ChatRequest(HI, response_format=JSON_ANSWER)).thinking == "open"


def test_a_forced_call_after_thinking_has_its_opener_forced(manager: TextOnly) -> None:
    prepared = prepare(manager, ChatRequest(HI, tools=[TOOL], tool_choice=NamedTool("get_weather"),
                                            thinking_budget=ThinkingBudget(100)))
    opener = manager.text.tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert engine_budget(prepared, under_grammar=True) == ReasoningBudget(
        budget=100, close_ids=[THINK_END], end_ids=END[:2], after_ids=opener)
    # Without a budget the opener is still forced after the model's own close.
    free = prepare(manager, ChatRequest(HI, tools=[TOOL], tool_choice="required"))
    assert engine_budget(free, under_grammar=True) == ReasoningBudget(
        budget=-1, close_ids=[THINK_END], end_ids=END[:2], after_ids=opener)
