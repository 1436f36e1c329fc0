"""Anthropic tools and tool_choice in the OpenAI function shape that
ChatRequest carries.

Custom tools ({name, description, input_schema}) become function tools.
Anthropic's server tools (web_search, code_execution, bash, text_editor,
computer, ...) run on Anthropic's side; nothing here can run them, so they
are refused with a 400 naming the tool rather than silently dropped.
"""

from __future__ import annotations

import re
from typing import Any

from router.anthropic.fields import refuse
from router.chat.request import NamedTool, ToolChoice

# Anthropic's rule for tool names.
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    checked: list[dict[str, Any]] = []
    seen: set[str] = set()
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        name = tool.get("name")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            shown = f"'{name}' ({kind})" if isinstance(name, str) else repr(kind)
            raise refuse(f"{where}.type", f"tool {shown} is a server tool, which runs on Anthropic's "
                         "side; this server runs none. Send custom tools ({name, description, input_schema})")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise refuse(f"{where}.name", "a tool name must match ^[a-zA-Z0-9_-]{1,128}$")
        if name in seen:
            raise refuse(f"{where}.name", f"tool names must be unique; {name!r} appears twice")
        seen.add(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise refuse(f"{where}.input_schema", f"tool {name!r} needs an input_schema, a JSON schema object")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise refuse(f"{where}.description", "a tool description must be a string", "invalid_type")
            function["description"] = description
        checked.append({"type": "function", "function": function})
    return checked


def tool_choice(choice: dict[str, Any] | None, tools: list[dict[str, Any]]) -> tuple[ToolChoice, bool]:
    """(the ChatRequest tool_choice, whether parallel tool calls are allowed).
    auto -> "auto", any -> "required", tool -> NamedTool, none -> "none"."""
    if choice is None:
        return "auto", True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return "auto", parallel
    if kind == "none":
        return "none", parallel
    if kind not in ("any", "tool"):
        raise refuse("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
    if not tools:
        raise refuse("tool_choice", f"{kind!r} needs tools, and none were given")
    if kind == "any":
        return "required", parallel
    name = choice.get("name")
    if not isinstance(name, str):
        raise refuse("tool_choice.name", "a tool_choice of type 'tool' needs the tool's name")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise refuse("tool_choice.name", f"{name!r} is not among the tools")
    return NamedTool(name), parallel
