"""Grammars that make a turn's tool calls and JSON answers well-formed.

They are xgrammar structural tags (JSON) built here and enforced by the engine
(GrammarSpec kind "structural_tag"): the router cannot import xgrammar (it
pulls in torch), and the tag format is plain data. The shapes follow what
xgrammar's own builtin tags give for Qwen3 (`<tool_call>` + JSON) and
Qwen3-Coder (`<tool_call>` + `<function=...>` XML).
"""

from __future__ import annotations

import json
from typing import Any

from protocol import GrammarSpec

_FORMATS = {
    "hermes": {
        "trigger": "<tool_call>",
        "begin": '<tool_call>\n{{"name": "{name}", "arguments": ',
        "style": "json",
        "end": "}\n</tool_call>",
    },
    "qwen3_coder": {
        "trigger": "<tool_call>\n<function=",
        "begin": "<tool_call>\n<function={name}>\n",
        "style": "qwen_xml",
        "end": "\n</function>\n</tool_call>",
    },
}
_THINK_TAGS = ["<think>", "</think>"]


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def _call_tag(tool_format: str, tool: dict[str, Any]) -> dict[str, Any]:
    shape = _FORMATS[tool_format]
    return {
        "type": "tag",
        "begin": shape["begin"].format(name=tool["function"]["name"]),
        "content": {"type": "json_schema", "json_schema": _schema(tool), "style": shape["style"]},
        "end": shape["end"],
    }


def _with_thinking(body: dict[str, Any], thinking: str) -> dict[str, Any]:
    """Let the model think first: "open" when its output starts with
    <think>, "inside" when the prompt already opened it, "off" otherwise."""
    if thinking == "off":
        return body
    think = {
        "type": "tag",
        "begin": "<think>" if thinking == "open" else "",
        "content": {"type": "any_text", "excludes": _THINK_TAGS},
        "end": "</think>",
    }
    return {"type": "sequence", "elements": [think, body]}


def forced_tool_grammar(
    tool_format: str,
    tools: list[dict[str, Any]],
    *,
    only: str | None,
    parallel: bool,
    thinking: str,
) -> GrammarSpec:
    """The turn must call a tool: `only` names the one it must call, else any
    of `tools`, once or (parallel) several times."""
    if only is not None:
        (tool,) = [t for t in tools if t["function"]["name"] == only]
        body: dict[str, Any] = _call_tag(tool_format, tool)
    else:
        body = {
            "type": "triggered_tags",
            "triggers": [_FORMATS[tool_format]["trigger"]],
            "tags": [_call_tag(tool_format, tool) for tool in tools],
            "at_least_one": True,
            "stop_after_first": not parallel,
            "excludes": _THINK_TAGS,
        }
    tag = {"type": "structural_tag", "format": _with_thinking(body, thinking)}
    return GrammarSpec("structural_tag", json.dumps(tag))


def answer_grammar(answer: GrammarSpec, thinking: str) -> GrammarSpec:
    """A JSON answer format (json_schema / json_object) after optional thinking."""
    if thinking == "off":
        return answer
    schema: Any = json.loads(answer.source) if answer.kind == "json_schema" else {"type": "object"}
    body = {"type": "json_schema", "json_schema": schema}
    tag = {"type": "structural_tag", "format": _with_thinking(body, thinking)}
    return GrammarSpec("structural_tag", json.dumps(tag))
