"""The parsers as the chat layer uses them: picked from the chat template, reasoning first, calls in content only."""

from __future__ import annotations

from router.chat.events import ContentDelta as C
from router.chat.events import ReasoningDelta as R
from router.chat.events import ToolCallDelta, ToolCallEnd, ToolCallStart
from router.parsers import detect_reasoning, detect_tool_format
from tests.router.parsers.support import calls, chained_events, tool_events

QWEN3_TEMPLATE_BITS = (
    '{{- "<tool_call>\\n{\\"name\\": \\"<function-name>\\", \\"arguments\\": <args-json-object>}\\n</tool_call>" }}'
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
CODER_TEMPLATE_BITS = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"


def test_detect_tool_format() -> None:
    assert detect_tool_format(QWEN3_TEMPLATE_BITS) == "hermes"
    assert detect_tool_format(CODER_TEMPLATE_BITS) == "qwen3_coder"
    assert detect_tool_format("{{ messages }}<|im_start|>assistant") is None


def test_detect_reasoning() -> None:
    assert detect_reasoning(QWEN3_TEMPLATE_BITS, "<|im_start|>assistant\n") == (True, False)
    assert detect_reasoning(QWEN3_TEMPLATE_BITS, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == (True, False)
    assert detect_reasoning("{{'<think>\\n'}}", "<｜Assistant｜><think>\n") == (True, True)
    assert detect_reasoning("{{ messages }}", "assistant: ") == (False, False)


def test_qwen3_thinking_then_a_call() -> None:
    text = (
        "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
    )
    events = chained_events(text)
    assert events == [
        R("The user wants the weather in Paris. I should call get_weather."),
        ToolCallStart(0, "id0", "get_weather"),
        ToolCallDelta(0, '{"city": "Paris", "unit": "°C"}'),
        ToolCallEnd(0, "id0", "get_weather", '{"city": "Paris", "unit": "°C"}'),
    ]


def test_markup_inside_reasoning_stays_reasoning() -> None:
    thought = 'Maybe:\n<tool_call>\n{"name": "draft", "arguments": {}}\n</tool_call>\nNo, better:'
    text = f"<think>\n{thought}\n</think>\n\nHere:\n" + '<tool_call>\n{"name": "final", "arguments": {}}\n</tool_call>'
    events = chained_events(text)
    assert events[0] == R(thought) and events[1] == C("Here:")
    assert calls(events) == [("final", "{}")]


def test_markup_inside_unterminated_reasoning_stays_reasoning() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert chained_events(text, start_in_reasoning=True) == [R(text)]


def test_qwen3_coder_after_thinking_with_emoji() -> None:
    text = "<think>\n🤔\n</think>\n\nOK 👍\n<tool_call>\n<function=say>\n<parameter=text>\nhé 😀\n</parameter>\n</function>\n</tool_call>"
    events = chained_events(text, "qwen3_coder")
    assert events[:2] == [R("🤔"), C("OK 👍")]
    assert calls(events) == [("say", '{"text": "hé 😀"}')]


def test_lone_surrogate_escapes_become_replacement_characters() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": \\"\\ud83d!\\udc00\\"}"}\n</tool_call>'
    assert calls(tool_events(text)) == [("f", '{"a": "\ufffd!\ufffd"}')]
