"""Responses tools as the chat template sees them, and the way back.

Function tools ({type: "function", name, description, parameters, strict})
become Chat Completions function tools. A namespace ({type: "namespace",
name, description, tools: [...]}) groups functions under a shared name; the
template has no notion of it, so each function inside is offered as
`<namespace>__<name>` with the namespace's description in front of its own,
and a call of that name comes back as {name, namespace} as the API shapes
it. Hosted tools (web search, file search, code interpreter, computer use,
image generation, MCP, shells, custom grammar tools) are refused: this
server runs none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.chat.request import NamedTool, ToolChoice
from router.http.errors import invalid
from router.json_schema_limits import check_enforceable

NAMESPACE_SEPARATOR = "__"


@dataclass(frozen=True)
class ToolSet:
    # Chat Completions function tools, in the order given, for the template.
    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    # The name the model sees -> (namespace or None, the function's own name).
    origins: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    # The names the model sees of functions with strict: true.
    strict: frozenset[str] = frozenset()

    def origin(self, model_name: str) -> tuple[str | None, str]:
        """The namespace and name of a call the model made (by the name it saw)."""
        return self.origins.get(model_name, (None, model_name))

    @staticmethod
    def model_name(name: str, namespace: str | None) -> str:
        """The name the model sees for a function (of a namespace or not)."""
        if namespace is None or namespace == name:
            # Deferred top-level functions may carry their own name as namespace.
            return name
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def tool_set(tools: list[dict[str, Any]] | None) -> ToolSet:
    chat_tools: list[dict[str, Any]] = []
    origins: dict[str, tuple[str | None, str]] = {}
    strict: set[str] = set()
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(f"'{where}' must be an object", where, "invalid_type")
        kind = tool.get("type")
        if kind == "function":
            seen_as = _add(chat_tools, origins, _function(tool, where), None, "", where)
            if _is_strict(tool, where):
                strict.add(seen_as)
        elif kind == "namespace":
            namespace = _name(tool, where)
            description = tool.get("description") or ""
            inner = tool.get("tools")
            if not isinstance(inner, list) or not inner:
                raise invalid("a namespace needs 'tools', a non-empty list of function tools",
                              f"{where}.tools", "invalid_type")
            for inner_index, inner_tool in enumerate(inner):
                inner_where = f"{where}.tools[{inner_index}]"
                if not isinstance(inner_tool, dict) or inner_tool.get("type") != "function":
                    raise invalid("only function tools may be in a namespace here", f"{inner_where}.type")
                seen_as = _add(chat_tools, origins, _function(inner_tool, inner_where), namespace,
                               description, inner_where)
                if _is_strict(inner_tool, inner_where):
                    strict.add(seen_as)
        else:
            raise invalid(f"tool type {kind!r} is not supported: this server runs no hosted or custom "
                          "tools; give function tools (or namespaces of them)", f"{where}.type")
    return ToolSet(chat_tools, origins, frozenset(strict))


def _name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{where}.name' must be a non-empty string", f"{where}.name",
                      "missing_required_parameter" if name is None else "invalid_type")
    return name


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": _name(tool, where)}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid(f"'{where}.description' must be a string", f"{where}.description", "invalid_type")
        function["description"] = description
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise invalid("parameters must be a JSON schema object", f"{where}.parameters", "invalid_type")
        function["parameters"] = parameters
    return function


def _is_strict(tool: dict[str, Any], where: str) -> bool:
    """strict: true, whose calls follow the schema (tool_grammar.py), so the
    schema may hold no keyword the grammar would drop."""
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"'{where}.strict' must be a boolean", f"{where}.strict", "invalid_type")
    if strict:
        check_enforceable(tool.get("parameters"), f"{where}.parameters")
    return bool(strict)


def _add(chat_tools: list[dict[str, Any]], origins: dict[str, tuple[str | None, str]],
         function: dict[str, Any], namespace: str | None, namespace_description: str,
         where: str) -> str:
    """Offers the function; returns the name the model sees."""
    name = function["name"]
    seen_as = ToolSet.model_name(name, namespace)
    if seen_as in origins:
        raise invalid(f"two tools are named {seen_as!r}", f"{where}.name")
    origins[seen_as] = (namespace, name)
    if namespace is not None:
        description = " ".join(filter(None, [namespace_description, function.get("description")]))
        function = {**function, "name": seen_as, **({"description": description} if description else {})}
    chat_tools.append({"type": "function", "function": function})
    return seen_as


def tool_choice(choice: str | dict[str, Any] | None, tools: ToolSet) -> ToolChoice:
    if choice is None:
        return "auto" if tools.chat_tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid(f"'tool_choice' must be auto, none, required or a function, got {choice!r}",
                          "tool_choice")
        if choice == "required" and not tools.chat_tools:
            raise invalid("'tool_choice' is required but no tools were given", "tool_choice")
        return choice
    if choice.get("type") != "function":
        raise invalid(f"tool_choice type {choice.get('type')!r} is not supported; use auto, none, "
                      "required or {\"type\": \"function\", \"name\": ...}", "tool_choice")
    name = choice.get("name")
    if not isinstance(name, str):
        raise invalid("a function tool_choice needs 'name'", "tool_choice.name")
    namespace = choice.get("namespace")
    seen_as = ToolSet.model_name(name, namespace if isinstance(namespace, str) else None)
    if seen_as not in tools.origins:
        raise invalid(f"tool_choice names {seen_as!r}, which is not among the tools", "tool_choice.name")
    return NamedTool(seen_as)
