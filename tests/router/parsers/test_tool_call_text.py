"""What counts as a tool call in content: line starts, quoted markup, code, whitespace, prefill."""

from __future__ import annotations

import pytest

from router.chat.events import ContentDelta as C
from router.chat.events import ToolCallDelta, ToolCallEnd, ToolCallStart
from router.parsers import ToolCallParser
from tests.router.parsers.support import calls, content, tool_events

HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
CODER_CALL = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
FORMATS = [("hermes", HERMES_CALL), ("qwen3_coder", CODER_CALL)]
F_CALL = [("f", '{"a": 1}')]


@pytest.mark.parametrize(("fmt", "call"), FORMATS)
def test_markup_quoted_in_prose_is_text(fmt: str, call: str) -> None:
    text = f"To call a tool, write {call} like that, or `{call}` in code."
    assert tool_events(text, fmt) == [C(text)]


@pytest.mark.parametrize(("fmt", "call"), FORMATS)
def test_markup_in_an_inline_code_span_at_a_line_start_is_text(fmt: str, call: str) -> None:
    text = f"Example:\n`{call}`\n> {call}\n"
    assert tool_events(text, fmt) == [C(text)]


@pytest.mark.parametrize(("fmt", "call"), FORMATS)
def test_markup_in_fenced_code_blocks_is_text(fmt: str, call: str) -> None:
    fenced = f"Format:\n```xml\n{call}\n```\n  ~~~~\n{call}\n~~~\n{call}\n~~~~\n"
    events = tool_events(fenced + "Now for real:\n" + call, fmt)
    assert content(events) == fenced + "Now for real:"
    assert calls(events) == F_CALL


@pytest.mark.parametrize(("fmt", "call"), FORMATS)
def test_a_fence_closes_only_with_a_long_enough_bare_fence(fmt: str, call: str) -> None:
    text = f"````\n```\n{call}\n``` not a close\n{call}\n````\n{call}"
    events = tool_events(text, fmt)
    assert calls(events) == F_CALL and content(events) == text[: -len(call) - 1]


@pytest.mark.parametrize(("fmt", "call"), FORMATS)
def test_a_tag_indented_at_a_line_start_opens_a_call(fmt: str, call: str) -> None:
    events = tool_events(f"Checking:\n  \t{call}", fmt)
    assert events[0] == C("Checking:") and calls(events) == F_CALL


@pytest.mark.parametrize(("fmt", "call"), FORMATS)
def test_text_between_and_after_calls_is_content(fmt: str, call: str) -> None:
    events = tool_events(f"Two calls:\n{call}\nand then\n{call}\n\nDone.\n", fmt)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["ContentDelta", *["ToolCallStart", "ToolCallDelta", "ToolCallEnd"], "ContentDelta",
                     *["ToolCallStart", "ToolCallDelta", "ToolCallEnd"], "ContentDelta"]
    assert [e.text for e in events if isinstance(e, C)] == ["Two calls:", "and then", "Done.\n"]


def test_whitespace_not_next_to_a_call_is_kept() -> None:
    assert tool_events("  Hi\n\n  there \n\n") == [C("  Hi\n\n  there \n\n")]


def test_near_miss_tags_are_text() -> None:
    for text in ["<tool_callx>\n{}", "<tool_call", "<tool", "<\n<tool_call >", "<<tool_call>"]:
        assert tool_events(text) == [C(text)], text


def test_text_is_emitted_as_soon_as_it_cannot_be_markup() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("Hello wor") == [C("Hello wor")]
    assert parser.feed("ld \n") == [C("ld")]  # the whitespace may separate a call
    assert parser.feed("<tool_") == []
    assert parser.feed("cab") == [C(" \n<tool_cab")]
    assert parser.feed("\n<tool_call") == []
    start, *_ = parser.feed('>\n{"name": "f"')
    assert start == ToolCallStart(0, start.id, "f")  # at the name's closing quote
    end = [ToolCallDelta(0, "{}"), ToolCallEnd(0, start.id, "f", "{}")]
    assert parser.feed("}\n</tool_call>\n") == end


def test_nothing_in_nothing_out() -> None:
    assert tool_events("") == []


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool call format"):
        ToolCallParser("mistral")


def test_prefill_forcing_a_hermes_call() -> None:
    prefill = '<tool_call>\n{"name": "'
    events = tool_events('get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', prefill=prefill)
    assert events[0] == ToolCallStart(0, "id0", "get_weather")
    assert calls(events) == [("get_weather", '{"city": "Paris"}')] and content(events) == ""


def test_prefill_forcing_a_qwen3_coder_call() -> None:
    events = tool_events("get_time>\n</function>\n</tool_call>", "qwen3_coder", prefill="<tool_call>\n<function=")
    assert calls(events) == [("get_time", "{}")] and content(events) == ""


def test_prefill_with_a_complete_header_announces_it_first() -> None:
    parser = ToolCallParser("hermes", prefill='<tool_call>\n{"name": "f", "arguments": ')
    first = parser.feed("")
    assert len(first) == 1 and isinstance(first[0], ToolCallStart) and first[0].name == "f"
    assert calls(tool_events('{"a": 1}}</tool_call>', prefill='<tool_call>\n{"name": "f", "arguments": ')) == F_CALL


def test_a_broken_forced_call_returns_only_what_the_model_wrote() -> None:
    text = 'oops\n" garbage\nthen text'  # a raw newline: the name never parses
    assert tool_events(text, prefill='<tool_call>\n{"name": "') == [C(text)]


def test_prefill_text_is_not_sent_again() -> None:
    events = tool_events("and more.", prefill="Sure, here it is ")
    assert events == [C("and more.")]
