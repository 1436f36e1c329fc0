"""Qwen3-Coder XML tool calls: values typed by the tool's schema, newline rules, omitted tags, broken and cut-off calls."""

from __future__ import annotations

import json

from router.chat.events import ContentDelta as C
from router.chat.events import ToolCallDelta, ToolCallStart
from router.parsers import ToolCallParser
from tests.router.parsers.support import calls, content, tool_events

SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "flag": {"type": "boolean"},
        "options": {"type": "object"},
        "items": {"type": "array"},
        "zip": {"type": "string"},
        "maybe": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
        "code": {"type": "string"},
    },
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]


def xml_call(name: str, *parameters: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def arguments(text: str, tools: list[dict] | None = TOOLS) -> dict:
    ((_, args),) = calls(tool_events(text, "qwen3_coder", tools))
    return json.loads(args)


def test_values_typed_by_the_schema() -> None:
    text = xml_call(
        "f",
        ("count", "3"),
        ("ratio", "0.25"),
        ("flag", "True"),
        ("options", '{"deep": {"a": [1, "}"]}}'),
        ("items", "[1, 2, 3]"),
        ("zip", "01234"),
        ("maybe", "null"),
        ("either", "false"),
    )
    assert arguments(text) == {
        "count": 3,
        "ratio": 0.25,
        "flag": True,
        "options": {"deep": {"a": [1, "}"]}},
        "items": [1, 2, 3],
        "zip": "01234",
        "maybe": None,
        "either": False,
    }


def test_arguments_text_is_one_json_object() -> None:
    (_, args), = calls(tool_events(xml_call("f", ("count", "3"), ("zip", "7")), "qwen3_coder", TOOLS))
    assert args == '{"count": 3, "zip": "7"}'


def test_values_that_do_not_parse_as_their_type_stay_strings() -> None:
    text = xml_call("f", ("count", "many"), ("ratio", "nan"), ("flag", "yes"), ("options", "{broken"), ("items", "{}"))
    assert arguments(text) == {"count": "many", "ratio": "nan", "flag": "yes", "options": "{broken", "items": "{}"}


def test_lenient_typed_values() -> None:
    text = xml_call("f", ("count", " 3.0 "), ("ratio", "7"), ("options", "{'a': True, 'b': None}"), ("items", "(1, 2)"))
    assert arguments(text) == {"count": 3, "ratio": 7, "options": {"a": True, "b": None}, "items": [1, 2]}


def test_without_a_schema_values_are_json_or_strings() -> None:
    text = xml_call(
        "g",
        ("n", "42"),
        ("t", "true"),
        ("z", "null"),
        ("l", '[1, "a"]'),
        ("o", "{not json"),
        ("s", "Paris"),
        ("story", "true story"),
        ("neg", "-1.5e3"),
        ("quoted", '"already a string"'),
        ("inf", "Infinity"),
        ("nan", "NaN"),
    )
    assert arguments(text, tools=None) == {
        "n": 42,
        "t": True,
        "z": None,
        "l": [1, "a"],
        "o": "{not json",
        "s": "Paris",
        "story": "true story",
        "neg": -1500.0,
        "quoted": "already a string",
        "inf": "Infinity",
        "nan": "NaN",
    }


def test_unknown_function_and_parameter_are_untyped_but_still_a_call() -> None:
    assert arguments(xml_call("unknown", ("count", "3"), ("x", "y")), TOOLS) == {"count": 3, "x": "y"}
    assert arguments(xml_call("f", ("extra", "[1]"))) == {"extra": [1]}


def test_one_leading_and_one_trailing_newline_are_stripped() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=code>\n\n  indented\n\n</parameter>\n<parameter=zip>X</parameter>\n</function>\n</tool_call>"
    assert arguments(text) == {"code": "\n  indented\n", "zip": "X"}


def test_code_values_keep_markup_and_quotes() -> None:
    code = 'def f():\n    return "<div>" + \'</param\' + "\\n" + "</parameter"\n# </function\n<parameter x>'
    assert arguments(xml_call("f", ("code", code))) == {"code": code}


def test_unicode_values_and_names() -> None:
    assert arguments(xml_call("météo", ("ville", "Zürich 🇨🇭 😀"), ("n", "3")), None) == {"ville": "Zürich 🇨🇭 😀", "n": 3}


def test_omitted_parameter_and_function_ends() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=zip>\na\n<parameter=count>\n2\n</function>\n</tool_call>"
    assert arguments(text) == {"zip": "a", "count": 2}
    text = "<tool_call>\n<function=f>\n<parameter=zip>\na\n</tool_call>\nAfter."
    events = tool_events(text, "qwen3_coder", TOOLS)
    assert calls(events) == [("f", '{"zip": "a"}')] and content(events) == "After."


def test_no_parameters_is_an_empty_object() -> None:
    assert calls(tool_events("<tool_call>\n<function=now>\n</function>\n</tool_call>", "qwen3_coder")) == [("now", "{}")]


def test_two_and_three_parallel_calls() -> None:
    two = xml_call("a", ("x", "1")) + "\n" + xml_call("b")
    assert calls(tool_events(two, "qwen3_coder")) == [("a", '{"x": 1}'), ("b", "{}")]
    three = "Calling three.\n" + xml_call("a") + xml_call("b", ("s", "t")) + "\n\n" + xml_call("c", ("n", "2.5"))
    events = tool_events(three, "qwen3_coder")
    assert calls(events) == [("a", "{}"), ("b", '{"s": "t"}'), ("c", '{"n": 2.5}')]
    assert content(events) == "Calling three."


def test_string_values_stream_before_they_end() -> None:
    parser = ToolCallParser("qwen3_coder", TOOLS)
    start, = parser.feed("<tool_call>\n<function=f>\n")
    assert start == ToolCallStart(0, start.id, "f")
    assert parser.feed("<parameter=code>\nline one\nline") == [ToolCallDelta(0, '{"code": "line one\\nline')]
    assert parser.feed(" two\n</para") == [ToolCallDelta(0, " two")]
    assert parser.feed("meter>\n<parameter=count>\n4") == [ToolCallDelta(0, '", "count": ')]
    assert parser.feed("2\n</parameter>") == [ToolCallDelta(0, "42")]
    # Without a schema, text that cannot start JSON streams at once.
    parser = ToolCallParser("qwen3_coder")
    assert parser.feed("<tool_call>\n<function=g>\n<parameter=s>\n")[1:] == [ToolCallDelta(0, '{"s": ')]
    assert parser.feed("Par") == [ToolCallDelta(0, '"Par')]
    # ... while a true/false/null prefix waits.
    parser = ToolCallParser("qwen3_coder")
    parser.feed("<tool_call>\n<function=g>\n<parameter=s>\n")
    assert parser.feed("tr") == []
    assert parser.feed("ip") == [ToolCallDelta(0, '"trip')]


def test_malformed_headers_return_as_content_exactly() -> None:
    for broken in [
        "<tool_call>\nhello\n</tool_call>",
        "<tool_call>\n<function>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=a\nb>\n</tool_call>",
        '<tool_call>\n{"name": "hermes style"}\n</tool_call>',
    ]:
        text = "Before.\n" + broken + "\nAfter."
        assert tool_events(text, "qwen3_coder") == [C(text)], broken


def test_unterminated_call_with_its_header() -> None:
    cut_in_string = "<tool_call>\n<function=f>\n<parameter=zip>\nPar"
    assert calls(tool_events(cut_in_string, "qwen3_coder", TOOLS)) == [("f", '{"zip": "Par')]
    cut_in_number = "<tool_call>\n<function=f>\n<parameter=zip>\nA\n</parameter>\n<parameter=count>\n12\n</param"
    assert calls(tool_events(cut_in_number, "qwen3_coder", TOOLS)) == [("f", '{"zip": "A", "count": 12')]
    cut_between = "<tool_call>\n<function=f>\n<parameter=count>\n1\n</parameter>\n<parameter=zi"
    assert calls(tool_events(cut_between, "qwen3_coder", TOOLS)) == [("f", '{"count": 1}')]


def test_unterminated_call_without_its_header_is_content() -> None:
    for text in ["<tool_call>\n<function=get_wea", "<tool_call>\n<func", "Hi\n<tool_call>\n"]:
        assert tool_events(text, "qwen3_coder") == [C(text)], text


def test_junk_between_parameters_ends_the_call_and_is_content() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=count>\n1\n</parameter>\nI changed my mind.\n"
    events = tool_events(text, "qwen3_coder", TOOLS)
    assert calls(events) == [("f", '{"count": 1}')]
    assert content(events) == "I changed my mind.\n"
    text = "<tool_call>\n<function=f>\n<parameter=bad\nname>\nx\n</parameter>\n</function>\n</tool_call>"
    events = tool_events(text, "qwen3_coder", TOOLS)
    assert calls(events) == [("f", "{}")]
    assert content(events) == "<parameter=bad\nname>\nx\n</parameter>\n</function>\n</tool_call>"
