"""A Responses request as a ChatRequest; refusals name the field."""

from __future__ import annotations

import json

import msgspec
import pytest

from protocol import GrammarSpec
from router.chat.request import NamedTool
from router.chat.thinking_budget import ThinkingBudget
from router.errors import RouterError
from router.http.errors import api_error
from router.responses.request_map import build_plan
from router.responses.schema import ResponsesRequest
from router.responses.store import ResponseStore, stored


def request(**fields: object) -> ResponsesRequest:
    return msgspec.convert({"model": "m", "input": "Hi", **fields}, ResponsesRequest)


def plan(responses: ResponseStore | None = None, **fields: object):  # type: ignore[no-untyped-def]
    return build_plan(request(**fields), responses or ResponseStore(10, 1 << 20))


def test_the_mapped_request() -> None:
    got = plan(instructions="Be brief.", max_output_tokens=64, temperature=0.2, top_p=0.9,
               tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "f"},
               parallel_tool_calls=False, reasoning={"effort": "none", "summary": "auto"},
               text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
               metadata={"k": "v"}, user="u", store=False, stream=True)
    chat = got.chat
    assert chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (chat.sampling.max_tokens, chat.sampling.temperature, chat.sampling.top_p) == (64, 0.2, 0.9)
    assert chat.tools == [{"type": "function", "function": {"name": "f"}}]
    assert chat.tool_choice == NamedTool("f") and chat.parallel_tool_calls is False
    assert chat.enable_thinking is False
    assert chat.response_format == GrammarSpec("json_schema", json.dumps({"type": "object"}))
    assert not got.store and got.stream
    assert got.echo["metadata"] == {"k": "v"} and got.echo["user"] == "u"
    assert got.echo["reasoning"] == {"effort": "none", "summary": "auto"}


def test_defaults() -> None:
    got = plan()
    assert got.store and not got.stream and got.chat.tool_choice == "none"
    assert got.chat.enable_thinking is None and got.chat.response_format is None
    assert plan(text={"format": {"type": "json_object"}}).chat.response_format == GrammarSpec("json_object")
    high = plan(reasoning={"effort": "high"}).chat
    assert high.enable_thinking is None and high.thinking_budget == ThinkingBudget(24576, default=True)
    assert plan().chat.thinking_budget is None


def test_previous_response_id_puts_the_stored_conversation_first() -> None:
    store = ResponseStore(10, 1 << 20)
    first = plan(store, input="Weather?")
    call = {"id": "fc_1", "type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}",
            "status": "completed"}
    store.put(stored({"id": "resp_1", "output": [call]}, first.input_items, None))
    got = plan(store, previous_response_id="resp_1",
               input=[{"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert [m["role"] for m in got.chat.messages] == ["user", "assistant", "tool"]
    assert [i["type"] for i in got.history] == ["message", "function_call"]
    assert [i["type"] for i in got.input_items] == ["function_call_output"]


def test_an_unknown_previous_response_is_a_400() -> None:
    with pytest.raises(RouterError) as error:
        plan(previous_response_id="resp_nope")
    assert (api_error(error.value).status, error.value.code, error.value.param) == (
        400, "previous_response_not_found", "previous_response_id")
    assert error.value.message == "Previous response with id 'resp_nope' not found."


@pytest.mark.parametrize(("fields", "param"), [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"input": []}, "input"),
])
def test_what_we_cannot_do_names_the_field(fields: dict, param: str) -> None:
    with pytest.raises(RouterError) as error:
        plan(**fields)
    assert api_error(error.value).status == 400 and error.value.param == param


def test_neutral_values_are_accepted() -> None:
    plan(background=False, truncation="disabled", service_tier="auto", top_logprobs=0,
         include=["reasoning.encrypted_content"], text={"verbosity": "medium", "format": {"type": "text"}},
         prompt_cache_key="k", safety_identifier="s", max_tool_calls=3, stream_options={})


def test_logprobs_are_asked_for_only_with_the_include() -> None:
    """As OpenAI: top_logprobs alone returns none; the include alone lists
    each token's own log probability; both, its alternatives too."""
    included = ["message.output_text.logprobs"]
    assert plan(top_logprobs=5).chat.sampling.logprobs == -1
    assert plan(include=included).chat.sampling.logprobs == 0
    got = plan(include=["reasoning.encrypted_content", *included], top_logprobs=20)
    assert got.chat.sampling.logprobs == 20 and got.echo["top_logprobs"] == 20
