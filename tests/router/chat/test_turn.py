"""Prompt rendering and grammar choice for a turn, with the real Qwen3 template."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from router.chat.request import ChatRequest, NamedTool
from router.chat.turn import PreparedTurn, _grammar, prepare_turn
from router.settings import ModelSettings
from router.text.model_text import ModelText

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HI = [{"role": "user", "content": "hi"}]


class TextOnly:
    """What prepare_turn needs of the manager: the model's text side."""

    def __init__(self, text: ModelText):
        self.text = text

    async def text_for(self, slot: object) -> ModelText:
        return self.text


@pytest.fixture(scope="module")
def manager(qwen3_tokenizer_dir: Path) -> TextOnly:
    return TextOnly(ModelText.load(qwen3_tokenizer_dir))


def prepare(manager: TextOnly, request: ChatRequest, **settings: object) -> PreparedTurn:
    """The turn for a model served with these settings (--reasoning-budget, ...)."""
    slot = SimpleNamespace(entry=SimpleNamespace(settings=ModelSettings(**settings)))  # type: ignore[arg-type]
    return asyncio.run(prepare_turn(manager, slot, request))  # type: ignore[arg-type]


def test_thinking_follows_the_template(manager: TextOnly) -> None:
    assert prepare(manager, ChatRequest(HI)).thinking == "open"
    off = prepare(manager, ChatRequest(HI, enable_thinking=False))
    assert off.thinking == "off" and off.prompt.endswith("<think>\n\n</think>\n\n")


def test_tools_reach_the_template_unless_the_choice_is_none(manager: TextOnly) -> None:
    with_tools = prepare(manager, ChatRequest(HI, tools=[TOOL]))
    assert "get_weather" in with_tools.prompt and with_tools.tool_format == "hermes"
    assert _grammar(with_tools) is None  # auto: free text, parsed afterwards
    without = prepare(manager, ChatRequest(HI, tools=[TOOL], tool_choice="none"))
    assert "get_weather" not in without.prompt and without.tool_format is None


def test_forced_calls_get_a_grammar_that_lets_the_model_think_first(manager: TextOnly) -> None:
    named = prepare(manager, ChatRequest(HI, tools=[TOOL], tool_choice=NamedTool("get_weather")))
    grammar = _grammar(named)
    assert grammar is not None and grammar.kind == "structural_tag"
    tag = json.loads(grammar.source)["format"]
    # The block opens in the prompt; the engine forces the call's opener
    # once the block closes (the prompt cannot carry it after the thinking).
    assert named.thinking == "inside" and named.prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert named.after_block == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert named.opener == ""
    assert tag["type"] == "sequence" and tag["elements"][0]["begin"] == ""
    assert tag["elements"][1]["begin"].startswith('<tool_call>\n{"name": "get_weather"')
    quiet = prepare(manager, ChatRequest(HI, tools=[TOOL], tool_choice="required", enable_thinking=False,
                                         parallel_tool_calls=False))
    # Thinking off: the wrapper is in the prompt, the grammar takes the rest
    # of one call and then only the end of the turn.
    # One tool to call: "required" names it.
    assert quiet.opener == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert quiet.prompt.endswith('</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ')
    tag = json.loads(_grammar(quiet).source)["format"]  # type: ignore[union-attr]
    assert tag["type"] == "tag" and tag["begin"] == ""
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    two = prepare(manager, ChatRequest(HI, tools=[TOOL, other], tool_choice="required",
                                       enable_thinking=False, parallel_tool_calls=False))
    assert two.opener == '<tool_call>\n{"name": "'
    tag = json.loads(_grammar(two).source)["format"]  # type: ignore[union-attr]
    assert tag["type"] == "or"
    assert [t["begin"] for t in tag["elements"]] == ['get_weather", "arguments": ',
                                                     'get_time", "arguments": ']
    named_quiet = prepare(manager, ChatRequest(HI, tools=[TOOL], tool_choice=NamedTool("get_weather"),
                                               enable_thinking=False))
    assert named_quiet.prompt.endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert json.loads(_grammar(named_quiet).source)["format"]["begin"] == ""  # type: ignore[union-attr]


def test_a_prefill_is_continued_not_closed(manager: TextOnly) -> None:
    prepared = prepare(manager, ChatRequest(HI, prefill="The answer is", enable_thinking=False))
    assert prepared.prompt.endswith("The answer is")
    assert prepared.prompt.count("<|im_start|>assistant") == 1


def test_strict_tools_under_auto_get_a_triggered_grammar(manager: TextOnly) -> None:
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    strict = ChatRequest(HI, tools=[TOOL, other], strict_tools=frozenset({"get_weather"}))
    grammar = _grammar(prepare(manager, strict))
    assert grammar is not None and grammar.kind == "structural_tag"
    tag = json.loads(grammar.source)["format"]
    # The model thinks first (free), then writes free text until <tool_call>.
    assert tag["type"] == "sequence" and tag["elements"][0]["begin"] == "<think>"
    calls = tag["elements"][1]
    assert calls["type"] == "triggered_tags" and calls["triggers"] == ["<tool_call>"]
    assert not calls["at_least_one"] and not calls["stop_after_first"]
    weather, time = calls["tags"]
    assert weather["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert weather["content"]["json_schema"] == TOOL["function"]["parameters"]
    # A tool without strict keeps free arguments.
    assert time["begin"] == '<tool_call>\n{"name": "get_time", "arguments": '
    assert time["content"] == {"type": "any_text"}

    quiet = prepare(manager, ChatRequest(HI, tools=[TOOL], strict_tools=frozenset({"get_weather"}),
                                         enable_thinking=False, parallel_tool_calls=False))
    assert quiet.opener == ""  # nothing is forced: the prompt is the plain one
    tag = json.loads(_grammar(quiet).source)["format"]  # type: ignore[union-attr]
    assert tag["type"] == "triggered_tags" and tag["stop_after_first"]

    # No strict tool, or none offered: the output stays free.
    assert _grammar(prepare(manager, ChatRequest(HI, tools=[TOOL, other]))) is None
    assert _grammar(prepare(manager, ChatRequest(HI, tools=[TOOL], tool_choice="none",
                                                 strict_tools=frozenset({"get_weather"})))) is None
