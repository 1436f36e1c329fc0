"""Hermes tool calls (a JSON object per <tool_call>): parallel calls, JSON edge cases, broken and cut-off calls."""

from __future__ import annotations

import json

from router.chat.events import ContentDelta as C
from router.chat.events import ToolCallDelta, ToolCallStart
from router.parsers import ToolCallParser
from tests.router.parsers.support import calls, content, tool_events

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_one_call_with_text_before_and_after() -> None:
    text = "Let me check.\n\n" + call("get_weather", '{"city": "Paris"}') + "\n\nDone."
    events = tool_events(text)
    assert calls(events) == [("get_weather", '{"city": "Paris"}')]
    assert events[0] == C("Let me check.") and events[-1] == C("Done.")
    assert isinstance(events[1], ToolCallStart) and events[1].index == 0


def test_two_and_three_parallel_calls() -> None:
    two = call("a", "{}") + "\n" + call("b", '{"x": 1}')
    assert calls(tool_events(two)) == [("a", "{}"), ("b", '{"x": 1}')]
    three = call("a", "{}") + call("b", "[1]") + "\n\n  " + call("c", '{"y": [2]}') + "\n"
    events = tool_events(three)
    assert calls(events) == [("a", "{}"), ("b", "[1]"), ("c", '{"y": [2]}')]
    assert content(events) == ""


def test_arguments_stream_verbatim_with_braces_and_quotes_in_strings() -> None:
    arguments = '{"code": "if (a) { f(\\"}\\"); } // ]", "n": {"a": [1, {"b": "\\\\"}]}, "s": "</tool_call>"}'
    json.loads(arguments)
    events = tool_events(call("run", arguments))
    assert calls(events) == [("run", arguments)]


def test_arguments_stream_as_they_arrive() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed('<tool_call>\n{"name": "f') == []
    start, delta = parser.feed('", "arguments": {"q": "ab')
    assert start == ToolCallStart(0, start.id, "f") and delta == ToolCallDelta(0, '{"q": "ab')
    assert parser.feed('c"}') == [ToolCallDelta(0, 'c"}')]


def test_arguments_written_as_a_json_string_are_unwrapped() -> None:
    events = tool_events(call("f", '"{\\"city\\": \\"Z\\u00fcrich \\ud83d\\ude00\\"}"'))
    assert calls(events) == [("f", '{"city": "Zürich 😀"}')]


def test_arguments_before_the_name_follow_the_start() -> None:
    text = '<tool_call>\n{"arguments": {"a": {"b": 1}}, "name": "f"}\n</tool_call>'
    assert calls(tool_events(text)) == [("f", '{"a": {"b": 1}}')]


def test_missing_or_null_arguments_are_an_empty_object() -> None:
    text = '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", "arguments": null}</tool_call>'
    assert calls(tool_events(text)) == [("f", "{}"), ("g", "{}")]


def test_parameters_key_and_other_keys() -> None:
    text = '<tool_call>\n{"id": {"x": "}"}, "name": "f", "parameters": {"k": 2}, "type": "function"}\n</tool_call>'
    assert calls(tool_events(text)) == [("f", '{"k": 2}')]


def test_unicode_names_and_arguments() -> None:
    text = call("météo_☀", '{"ville": "Zürich 🇨🇭", "emoji": "😀"}')
    assert calls(tool_events(text)) == [("météo_☀", '{"ville": "Zürich 🇨🇭", "emoji": "😀"}')]


def test_unknown_function_is_still_a_call() -> None:
    assert calls(tool_events(call("not_a_tool", "{}"), tools=WEATHER)) == [("not_a_tool", "{}")]


def test_very_long_arguments() -> None:
    body = "x\\\"{}[]" * 3000 + "é" * 1000
    arguments = json.dumps({"data": body, "list": list(range(500))})
    assert calls(tool_events("ok\n" + call("big", arguments))) == [("big", arguments)]


def test_malformed_headers_return_as_content_exactly() -> None:
    for broken in [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": get_weather}\n</tool_call>',
        '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
        '<tool_call>\n{"name": ""}\n</tool_call>',
        '<tool_call>\n{"name": "a\nb"}\n</tool_call>',
        '<tool_call>\n{"name": "bad \\q escape"}\n</tool_call>',
        "<tool_call></tool_call>",
    ]:
        text = "Before.\n" + broken + "\nAfter."
        assert tool_events(text) == [C(text)], broken


def test_a_real_call_after_a_broken_one_is_found() -> None:
    text = "<tool_call>\noops\n" + call("f", "{}")
    events = tool_events(text)
    assert content(events) == "<tool_call>\noops"
    assert calls(events) == [("f", "{}")]


def test_unterminated_call_with_its_header_ends_with_the_arguments_so_far() -> None:
    events = tool_events('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert calls(events) == [("get_weather", '{"city": "Par')]
    assert content(events) == "Sure."
    assert calls(tool_events('<tool_call>\n{"name": "f"')) == [("f", "{}")]
    # A partial closing tag at the very end is markup, not arguments.
    assert calls(tool_events('<tool_call>{"name": "f", "arguments": {"a": 1}}\n</tool_')) == [("f", '{"a": 1}')]


def test_unterminated_call_without_its_header_is_content() -> None:
    text = 'Sure.\n<tool_call>\n{"na'
    assert tool_events(text) == [C(text)]
    assert tool_events("<tool_call>") == [C("<tool_call>")]


def test_closing_tag_ends_a_call_whose_json_never_closed() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2\n</tool_call>\nafter'
    events = tool_events(text)
    assert calls(events) == [("f", '{"a": [1, 2\n')]
    assert content(events) == "after"
    # The outer brace forgotten: a common slip.
    assert calls(tool_events('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>')) == [("f", '{"a": 1}')]


def test_a_less_than_inside_arguments_is_argument_text() -> None:
    arguments = '{"a": 1 <tool}'
    assert calls(tool_events(call("f", arguments))) == [("f", arguments)]


def test_junk_after_the_object_ends_the_call_and_is_content() -> None:
    events = tool_events('<tool_call>\n{"name": "f", "arguments": {}}} trailing\n</tool_call>')
    assert calls(events) == [("f", "{}")]
    assert content(events) == "} trailing\n</tool_call>"


def test_junk_where_a_key_belongs_ends_an_announced_call() -> None:
    events = tool_events('<tool_call>\n{"name": "f", "arguments": {"a": 1}, oops} rest')
    assert calls(events) == [("f", '{"a": 1}')]
    assert content(events) == "oops} rest"
