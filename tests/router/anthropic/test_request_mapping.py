"""Messages API requests -> ChatRequest: conversation, tools, thinking, and the
400s that name the field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.anthropic.conversation import TOOL_ERROR_PREFIX
from router.anthropic.request import chat_request, messages_request
from router.anthropic.schemas import CountTokensRequest, MessagesRequest
from router.chat.request import NamedTool
from router.chat.thinking_budget import ThinkingBudget
from router.errors import RouterError
from router.http.errors import ApiError, api_error, decode_body

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def make(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(body), MessagesRequest)


def refused(**fields: Any) -> ApiError:
    with pytest.raises(RouterError) as caught:
        messages_request(make(**fields))
    assert api_error(caught.value).status == 400 and api_error(caught.value).type == "invalid_request_error"
    return caught.value


def test_a_plain_request() -> None:
    chat, thinking = messages_request(make(system="Be brief.", stop_sequences=["END", ""],
                                           temperature=0.5, top_p=0.9, top_k=20))
    assert chat.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "hi"}]
    assert chat.sampling.max_tokens == 2048 and chat.sampling.stop == ("END",)
    assert (chat.sampling.temperature, chat.sampling.top_p, chat.sampling.top_k) == (0.5, 0.9, 20)
    assert chat.tool_id_prefix == "toolu_" and chat.prefill == ""
    assert thinking.enabled is None and chat.enable_thinking is None


def test_system_blocks_and_text_blocks_join() -> None:
    chat, _ = messages_request(make(
        system=[{"type": "text", "text": "One."}, {"type": "text", "text": "Two.", "cache_control": {}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    ))
    assert chat.messages == [{"role": "system", "content": "One.\nTwo."}, {"role": "user", "content": "a\nb"}]


def test_a_tool_round_trip_history() -> None:
    chat, _ = messages_request(make(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I call the tool.", "signature": "whatever"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "Thanks"},
        ]},
    ]))
    assert chat.messages[1] == {
        "role": "assistant", "content": "Checking.", "reasoning_content": "I call the tool.",
        "tool_calls": [{"id": "toolu_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    assert chat.messages[2] == {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather",
                                "content": "sunny"}
    assert chat.messages[3] == {"role": "user", "content": "Thanks"}
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": "Weather in a city"}}]


def test_a_failed_tool_call_says_so() -> None:
    chat, _ = messages_request(make(messages=[
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "no such city", "is_error": True},
            {"type": "tool_result", "tool_use_id": "u", "is_error": True}]},
    ]))
    assert chat.messages[0]["content"] == TOOL_ERROR_PREFIX + "no such city"
    assert chat.messages[1]["content"] == "Error"


def test_a_final_assistant_message_is_the_prefill() -> None:
    chat, _ = messages_request(make(messages=[
        {"role": "user", "content": "Pick one"},
        {"role": "assistant", "content": [{"type": "text", "text": "The answer is ("}]},
    ]))
    assert chat.prefill == "The answer is (" and chat.messages == [{"role": "user", "content": "Pick one"}]
    empty, _ = messages_request(make(messages=[{"role": "user", "content": "x"},
                                               {"role": "assistant", "content": ""}]))
    assert empty.prefill == ""


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        (None, "auto", True),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any"}, "required", True),
        ({"type": "tool", "name": "get_weather"}, NamedTool("get_weather"), True),
        ({"type": "none"}, "none", True),
    ],
)
def test_tool_choice(choice: dict | None, expected: object, parallel: bool) -> None:
    chat, _ = messages_request(make(tools=[WEATHER], tool_choice=choice))
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel


@pytest.mark.parametrize(
    ("thinking", "enabled", "show"),
    [
        ({"type": "disabled"}, False, True),
        ({"type": "enabled", "budget_tokens": 1024}, True, True),
        ({"type": "adaptive"}, None, True),
        ({"type": "enabled", "budget_tokens": 1024, "display": "omitted"}, True, False),
    ],
)
def test_thinking(thinking: dict, enabled: bool | None, show: bool) -> None:
    chat, choice = messages_request(make(thinking=thinking))
    assert chat.enable_thinking is enabled and choice.show is show
    # budget_tokens is held by the engine (router/chat/thinking_budget.py).
    budget = thinking.get("budget_tokens")
    assert chat.thinking_budget == (ThinkingBudget(budget) if budget else None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0].source.type"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
         "messages[0].content[0].content[0].source"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
         "messages[0].content[0].tool_use_id"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": []}]}, {"role": "user", "content": "y"}]},
         "messages[1].content[0].input"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure, "}]},
         "messages[1].content"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "messages[1].content[0].type"),
        ({"system": [{"type": "image"}]}, "system[0].type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "maybe"}}, "thinking.type"),
        ({"mcp_servers": [{"type": "url", "url": "https://x"}]}, "mcp_servers"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format.type"),
    ],
)
def test_what_is_refused_names_the_field(fields: dict, param: str) -> None:
    error = refused(**fields)
    assert error.param == param, error.message
    assert param in error.message


def test_the_server_tool_is_named() -> None:
    error = refused(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "web_search" in error.message


def test_missing_max_tokens_names_it() -> None:
    with pytest.raises(RouterError) as caught:
        decode_body(b'{"model": "m", "messages": []}', MessagesRequest)
    assert caught.value.param == "max_tokens" and caught.value.code == "missing_required_parameter"


def test_count_tokens_needs_no_max_tokens() -> None:
    req = decode_body(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                           "thinking": {"type": "enabled", "budget_tokens": 4096}}),
                      CountTokensRequest)
    assert chat_request(req).enable_thinking is True


def test_structured_output_becomes_a_response_format() -> None:
    chat, _ = messages_request(make(output_config={"format": {"type": "json_schema",
                                                               "schema": {"type": "object"}}}))
    assert chat.response_format is not None and chat.response_format.kind == "json_schema"


def test_streams_ask_for_prompt_progress() -> None:
    assert messages_request(make(stream=True))[0].sampling.report_progress
    assert not messages_request(make())[0].sampling.report_progress


def test_strict_tools_are_held_to_their_schema() -> None:
    chat, _ = messages_request(make(tools=[{**WEATHER, "strict": True}, {**WEATHER, "name": "other"}]))
    assert chat.strict_tools == {"get_weather"}
    error = refused(tools=[{**WEATHER, "strict": "yes"}])
    assert error.param == "tools[0].strict"
    unenforceable = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}
    error = refused(tools=[{**WEATHER, "strict": True, "input_schema": unenforceable}])
    assert error.param == "tools[0].input_schema.properties.n.multipleOf"
