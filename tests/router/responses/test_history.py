"""Items as template messages: turns, tool calls, reasoning, instructions."""

from __future__ import annotations

from router.responses.history import template_messages
from router.responses.items import canonical_input
from router.responses.tools import tool_set

CRM = {"type": "namespace", "name": "crm", "description": "",
       "tools": [{"type": "function", "name": "lookup"}]}


def messages(items: list[dict], instructions: str | None = None, tools: list | None = None) -> list[dict]:
    return template_messages(canonical_input(items), instructions, tool_set(tools or []))


def test_a_function_call_round_trip() -> None:
    got = messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ])
    assert got == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain", "name": "get_weather"},
    ]


def test_text_then_a_call_is_one_turn() -> None:
    got = messages([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "namespace": "crm", "arguments": "{}"},
    ], tools=[CRM])
    assert got[1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "crm__lookup", "arguments": {}}}]}


def test_instructions_and_developer_messages_are_one_system_message() -> None:
    got = messages([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "system", "content": "Later rule."}], instructions="You are helpful.")
    assert got == [{"role": "system", "content": "You are helpful.\n\nBe brief."},
                   {"role": "user", "content": "Hi"}, {"role": "system", "content": "Later rule."}]


def test_reasoning_goes_with_the_next_assistant_turn_only() -> None:
    got = messages([
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Greet."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "dangling"}]},
        {"role": "user", "content": "Bye"},
    ])
    assert got[1] == {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}
    assert got[2] == {"role": "user", "content": "Bye"}
