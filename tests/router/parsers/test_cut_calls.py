"""A tool call cut by the token limit (flush(cut=True)): reported as cut,
with the arguments as generated, and never shown as text."""

from __future__ import annotations

from router.chat.events import ContentDelta, ToolCallEnd, ToolCallStart
from router.parsers import ToolCallParser


def _events(fmt: str, text: str, *, cut: bool, prefill: str = "") -> list:
    parser = ToolCallParser(fmt, prefill=prefill)
    return parser.feed(text) + parser.flush(cut=cut)


def test_a_hermes_call_cut_in_its_arguments_keeps_what_was_generated() -> None:
    events = _events("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"city": "Pa', cut=True)
    end = events[-1]
    assert isinstance(end, ToolCallEnd) and not end.complete
    assert end.arguments == '{"city": "Pa'
    # Without the cut (the stream just ended) the old rule stands: a whole call.
    assert _events("hermes", '<tool_call>\n{"name": "f"}', cut=False)[-1].complete


def test_a_call_cut_before_any_arguments_invents_none() -> None:
    end = _events("hermes", '<tool_call>\n{"name": "f", ', cut=True)[-1]
    assert isinstance(end, ToolCallEnd) and end.arguments == "" and not end.complete


def test_a_call_cut_in_its_wrapper_is_dropped_not_shown() -> None:
    for text in ["Hi\n<tool_", 'Hi\n<tool_call>\n{"na', 'Hi\n<tool_call>\n{"name": "get_w']:
        events = _events("hermes", text, cut=True)
        assert not any(isinstance(e, ToolCallStart | ToolCallEnd) for e in events), text
        shown = "".join(e.text for e in events if isinstance(e, ContentDelta))
        assert shown == "Hi", text


def test_a_qwen3_coder_call_cut_in_a_value_is_not_closed() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=days>\n1"
    end = _events("qwen3_coder", text, cut=True)[-1]
    assert isinstance(end, ToolCallEnd) and not end.complete
    assert end.arguments == '{"days": 1' and not end.arguments.endswith("}")


def test_a_forced_call_opener_in_the_prompt_gives_the_same_events() -> None:
    opener = '<tool_call>\n{"name": "f", "arguments": '
    whole = _events("hermes", opener + '{"a": 1}}\n</tool_call>', cut=False)
    continued = _events("hermes", '{"a": 1}}\n</tool_call>', cut=False, prefill=opener)
    assert [type(e) for e in whole] == [type(e) for e in continued]
    assert whole[-1].arguments == continued[-1].arguments == '{"a": 1}'
