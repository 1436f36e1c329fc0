"""Every OpenAI request field takes effect or is refused with a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from protocol import GrammarSpec
from router.chat.request import NamedTool
from router.chat.thinking_budget import ThinkingBudget
from router.errors import InvalidRequest
from router.openai.chat_request import chat_request
from router.openai.guided import completion_constraint
from router.openai.params import check_common, sampling_request
from router.openai.schemas import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> Any:
    body = {"messages": USER, **fields}
    return chat_request(msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest))


def refused(call: Any, **fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        call(**fields)
    return caught.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"verbosity": "low"}, "verbosity"),
        ({"priority": 5}, "priority"),
        ({"thinking_budget": -2}, "thinking_budget"),
        ({"thinking_budget_tokens": -3}, "thinking_budget_tokens"),
        ({"chat_template_kwargs": {"thinking_budget": 1.5}}, "chat_template_kwargs.thinking_budget"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "add_generation_prompt"),
        ({"guided_regex": "a+", "guided_choice": ["x"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"lark": "x"}}, "structured_outputs.lark"),
        ({"tools": [], "functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_fields_we_cannot_honour_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    assert refused(chat, **fields).param == param


def test_neutral_values_are_accepted() -> None:
    chat(store=False, verbosity="medium", priority=0, thinking_budget=-1, service_tier="auto",
         logit_bias={"5": 0})


def test_thinking_budgets_and_effort_levels() -> None:
    assert chat().thinking_budget is None
    assert chat(thinking_budget=512).thinking_budget == ThinkingBudget(512)
    assert chat(thinking_budget_tokens=300).thinking_budget == ThinkingBudget(300)
    assert chat(chat_template_kwargs={"thinking_budget": 64}).thinking_budget == ThinkingBudget(64)
    # A count wins over an effort level, which is a default (capped to leave the answer room).
    assert chat(thinking_budget=100, reasoning_effort="high").thinking_budget == ThinkingBudget(100)
    assert chat(reasoning_effort="low").thinking_budget == ThinkingBudget(1024, default=True)
    low = chat(reasoning_effort="none")
    assert low.enable_thinking is False and low.thinking_budget == ThinkingBudget(0, default=True)


def test_two_assistant_messages_at_the_end_are_refused_as_llama_cpp_does() -> None:
    messages = [*USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    error = refused(chat, messages=messages)
    assert error.message == "Cannot have 2 or more assistant messages at the end of the list."
    assert error.param == "messages[2]"
    # Elsewhere in the conversation they are allowed.
    chat(messages=[*messages, *USER])


def test_continue_final_message_prefills_the_assistant_turn() -> None:
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    request = chat(messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert request.prefill == "The answer is" and request.messages == USER
    assert refused(chat, continue_final_message=True).param == "messages[0].role"
    assert chat(add_generation_prompt=False).add_generation_prompt is False


def test_legacy_functions_become_tools() -> None:
    function = {"name": "get_weather", "parameters": {"type": "object"}}
    request = chat(functions=[function], function_call={"name": "get_weather"})
    assert request.tools == [{"type": "function", "function": function}]
    assert request.tool_choice == NamedTool("get_weather")
    assert chat(functions=[function], function_call="none").tool_choice == "none"
    history = [*USER, {"role": "assistant", "content": None,
                       "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
               {"role": "function", "name": "get_weather", "content": "sunny"}]
    messages = chat(messages=history, functions=[function]).messages
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                         "arguments": {"city": "Oslo"}}
    assert messages[2] == {"role": "tool", "content": "sunny", "name": "get_weather"}


def test_llama_cpp_and_vllm_constraints_become_grammars() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(grammar='root ::= "yes"').response_format == GrammarSpec("ebnf", 'root ::= "yes"')
    assert chat(json_schema=schema).response_format == GrammarSpec("json_schema", json.dumps(schema))
    assert chat(response_format={"type": "json_object", "schema": schema}).response_format == \
        GrammarSpec("json_schema", json.dumps(schema))
    assert chat(guided_json=json.dumps(schema)).response_format == \
        GrammarSpec("json_schema", json.dumps(schema))
    assert chat(guided_regex="[0-9]+").response_format == GrammarSpec("regex", "[0-9]+")
    assert chat(guided_choice=["yes", 'say "no"']).response_format == \
        GrammarSpec("ebnf", 'root ::= "yes" | "say \\"no\\""')
    assert chat(structured_outputs={"grammar": "root ::= \"a\""}).response_format == \
        GrammarSpec("ebnf", 'root ::= "a"')


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
         "properties.tags.uniqueItems"),
        ({"type": "string", "pattern": "a+", "maxLength": 4}, "maxLength"),
        ({"anyOf": [{"type": "integer", "not": {"const": 3}}]}, "anyOf[0].not"),
        ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "allOf"),
    ],
)
def test_strict_schemas_refuse_keywords_the_grammar_cannot_enforce(schema: dict, where: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}
    error = refused(chat, response_format=response_format)
    assert error.param == f"response_format.json_schema.schema.{where}"
    assert error.code == "unsupported_schema_keyword"
    # Without strict the schema is followed as far as the grammar can.
    response_format["json_schema"]["strict"] = False
    chat(response_format=response_format)
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}]
    assert refused(chat, tools=tools).param == f"tools[0].function.parameters.{where}"
    # multipleOf on an integer is enforced.
    chat(response_format={"type": "json_schema", "json_schema": {
        "strict": True, "schema": {"type": "integer", "multipleOf": 3}}})


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.json.decode(json.dumps({"prompt": "x", **fields}), type=CompletionRequest)


def test_completion_fields() -> None:
    req = completion(logit_bias={"7": -100, "9": 2.5, "3": 0})
    check_common(req)
    assert sampling_request(req, 4).logit_bias == {7: -100.0, 9: 2.5}
    assert completion_constraint(completion(guided_choice=["a", "b"])) == \
        GrammarSpec("ebnf", 'root ::= "a" | "b"')
    assert completion_constraint(completion()) is None
    assert refused(lambda **f: check_common(completion(**f)), priority=1).param == "priority"


def test_strict_function_tools_are_held_to_their_schema() -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": params}},
             {"type": "function", "function": {"name": "g", "strict": False, "parameters": params}},
             {"type": "function", "function": {"name": "h", "parameters": params}}]
    assert chat(tools=tools).strict_tools == {"f"}
    assert chat(functions=[tools[0]["function"]]).strict_tools == {"f"}  # the legacy shape
    tools[0]["function"]["strict"] = "yes"
    assert refused(chat, tools=tools).param == "tools[0].function.strict"
