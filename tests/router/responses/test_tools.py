"""Function tools and namespaces as the template sees them, and the way back."""

from __future__ import annotations

import pytest

from router.chat.request import NamedTool
from router.errors import RouterError
from router.responses.tools import tool_choice, tool_set

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}
CRM = {"type": "namespace", "name": "crm", "description": "Customer records.",
       "tools": [{"type": "function", "name": "lookup", "description": "Find a customer",
                  "parameters": {"type": "object"}}]}


def test_functions_and_namespaces_become_function_tools() -> None:
    tools = tool_set([WEATHER, CRM])
    assert tools.chat_tools == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                          "parameters": WEATHER["parameters"]}},
        {"type": "function", "function": {"name": "crm__lookup",
                                          "description": "Customer records. Find a customer",
                                          "parameters": {"type": "object"}}},
    ]
    assert tools.origin("crm__lookup") == ("crm", "lookup")
    assert tools.origin("get_weather") == (None, "get_weather")
    assert tools.model_name("lookup", "crm") == "crm__lookup"


def test_tool_choice() -> None:
    tools = tool_set([WEATHER, CRM])
    assert tool_choice(None, tools) == "auto"
    assert tool_choice(None, tool_set([])) == "none"
    assert tool_choice("required", tools) == "required"
    assert tool_choice({"type": "function", "name": "get_weather"}, tools) == NamedTool("get_weather")
    assert tool_choice({"type": "function", "name": "crm__lookup"}, tools) == NamedTool("crm__lookup")


@pytest.mark.parametrize(("tools", "param"), [
    ([{"type": "web_search"}], "tools[0].type"),
    ([WEATHER, {"type": "file_search", "vector_store_ids": []}], "tools[1].type"),
    ([{"type": "code_interpreter", "container": {"type": "auto"}}], "tools[0].type"),
    ([{"type": "mcp", "server_label": "x"}], "tools[0].type"),
    ([{"type": "image_generation"}], "tools[0].type"),
    ([{"type": "computer_use_preview"}], "tools[0].type"),
    ([{"type": "custom", "name": "apply_patch"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].name"),
    ([{"type": "function", "name": "f", "parameters": "x"}], "tools[0].parameters"),
    ([WEATHER, WEATHER], "tools[1].name"),
    ([{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "c"}]}], "tools[0].tools[0].type"),
])
def test_unsupported_tools_name_the_field(tools: list, param: str) -> None:
    with pytest.raises(RouterError) as error:
        tool_set(tools)
    assert error.value.param == param


@pytest.mark.parametrize(("choice", "param"), [
    ("sometimes", "tool_choice"),
    ({"type": "function", "name": "nope"}, "tool_choice.name"),
    ({"type": "web_search_preview"}, "tool_choice"),
    ({"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice"),
])
def test_bad_tool_choices_name_the_field(choice: object, param: str) -> None:
    with pytest.raises(RouterError) as error:
        tool_choice(choice, tool_set([WEATHER]))  # type: ignore[arg-type]
    assert error.value.param == param


def test_strict_functions_are_named_with_the_name_the_model_sees() -> None:
    strict_crm = {**CRM, "tools": [{**CRM["tools"][0], "strict": True}]}
    assert tool_set([WEATHER, CRM]).strict == {"get_weather"}
    assert tool_set([{**WEATHER, "strict": False}, strict_crm]).strict == {"crm__lookup"}


def test_a_strict_function_in_a_namespace_refuses_keywords_the_grammar_cannot_enforce() -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    crm = {**CRM, "tools": [{**CRM["tools"][0], "strict": True, "parameters": schema}]}
    with pytest.raises(RouterError) as error:
        tool_set([crm])
    assert error.value.param == "tools[0].tools[0].parameters.properties.tags.uniqueItems"
    assert error.value.code == "unsupported_schema_keyword"
