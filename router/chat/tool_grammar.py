"""Grammars that make a turn's tool calls and JSON answers well-formed: forced
calls, calls of strict tools under tool_choice auto, answer formats.

They are xgrammar structural tags (JSON) built here and enforced by the engine
(GrammarSpec kind "structural_tag"): the router cannot import xgrammar (it
pulls in torch), and the tag format is plain data. The shapes follow what
xgrammar's own builtin tags give for Qwen3 (`<tool_call>` + JSON) and
Qwen3-Coder (`<tool_call>` + `<function=...>` XML).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from protocol import GrammarSpec

_FORMATS = {
    "hermes": {
        "opener": '<tool_call>\n{"name": "',
        "begin": '<tool_call>\n{{"name": "{name}", "arguments": ',
        "style": "json",
        "end": "}\n</tool_call>",
    },
    "qwen3_coder": {
        "opener": "<tool_call>\n<function=",
        "begin": "<tool_call>\n<function={name}>\n",
        "style": "qwen_xml",
        "end": "\n</function>\n</tool_call>",
    },
}
_THINK_TAGS = ["<think>", "</think>"]
# Every call of both formats starts with it (a strict call's trigger).
_TRIGGER = "<tool_call>"
assert all(shape["begin"].startswith(_TRIGGER) for shape in _FORMATS.values())


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def call_opener(tool_format: str, only: str | None) -> str:
    """The start of a forced call that the router writes into the prompt, so
    the model spends no tokens on it: the wrapper, and the name when the
    choice names one tool. The parser is fed the same text (its prefill)."""
    shape = _FORMATS[tool_format]
    if only is not None:
        return shape["begin"].format(name=only)
    return shape["opener"]  # up to the name, which the grammar picks among the tools


def _call_tag(tool_format: str, tool: dict[str, Any], *, before: str = "",
              opener: str = "") -> dict[str, Any]:
    shape = _FORMATS[tool_format]
    begin = shape["begin"].format(name=tool["function"]["name"])
    assert begin.startswith(opener)
    return {
        "type": "tag",
        "begin": before + begin[len(opener):],
        "content": {"type": "json_schema", "json_schema": _schema(tool), "style": shape["style"]},
        "end": shape["end"],
    }


def _one_of(tags: list[dict[str, Any]]) -> dict[str, Any]:
    return tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}


def _calls(tool_format: str, tools: list[dict[str, Any]], *, parallel: bool,
           opener: str) -> dict[str, Any]:
    """One call (its opener already in the prompt when given), then, when
    parallel, more calls each on a new line, then nothing: once the calls
    close, only an end-of-sequence token may follow, so the turn ends there
    instead of running on as free text to the token limit."""
    first = _one_of([_call_tag(tool_format, tool, opener=opener) for tool in tools])
    if not parallel:
        return first
    more = _one_of([_call_tag(tool_format, tool, before="\n") for tool in tools])
    return {"type": "sequence", "elements": [first, {"type": "star", "content": more}]}


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
    opener: str = "",
) -> GrammarSpec:
    """The turn must call a tool: `only` names the one it must call (once),
    else any of `tools`, once or (parallel) several times. `opener` is the
    start of the first call already written at the end of the prompt
    (call_opener); thinking is then "off"."""
    if only is not None:
        (tool,) = [t for t in tools if t["function"]["name"] == only]
        body: dict[str, Any] = _call_tag(tool_format, tool, opener=opener)
    else:
        body = _calls(tool_format, tools, parallel=parallel, opener=opener)
    tag = {"type": "structural_tag", "format": _with_thinking(body, thinking)}
    return GrammarSpec("structural_tag", json.dumps(tag))


def _free_call_tag(tool_format: str, tool: dict[str, Any]) -> dict[str, Any]:
    """A call of a tool without strict: its name and wrapper as the format
    spells them, its arguments unconstrained up to the end of the call."""
    shape = _FORMATS[tool_format]
    return {
        "type": "tag",
        "begin": shape["begin"].format(name=tool["function"]["name"]),
        "content": {"type": "any_text"},
        "end": shape["end"],
    }


def strict_tools_grammar(
    tool_format: str,
    tools: list[dict[str, Any]],
    *,
    strict: Collection[str],
    parallel: bool,
    thinking: str,
) -> GrammarSpec:
    """tool_choice auto with strict tools (`strict` names them): the answer is
    free text until it writes `<tool_call>`, which both formats open every
    call with; from there the call must be one of `tools`, and a strict
    tool's arguments follow its schema. The trigger is the wrapper alone, not
    the wrapper and a name, so no spelling of a strict call escapes it; the
    cost is that `<tool_call>` cannot appear in the text as anything but a
    call. Tools without strict keep free arguments (their name and wrapper
    still as the format writes them). Without parallel calls, only the end
    of the turn may follow the first call."""
    body = {
        "type": "triggered_tags",
        "triggers": [_TRIGGER],
        "tags": [
            _call_tag(tool_format, tool) if tool["function"]["name"] in strict
            else _free_call_tag(tool_format, tool)
            for tool in tools
        ],
        "at_least_one": False,
        "stop_after_first": not parallel,
    }
    tag = {"type": "structural_tag", "format": _with_thinking(body, thinking)}
    return GrammarSpec("structural_tag", json.dumps(tag))


def answer_grammar(answer: GrammarSpec, thinking: str) -> GrammarSpec:
    """An answer format (json_schema, json_object, regex or ebnf: response_format,
    vLLM's guided_* fields, llama.cpp's grammar) after optional thinking."""
    if thinking == "off":
        return answer
    body: dict[str, Any]
    if answer.kind == "regex":
        body = {"type": "regex", "pattern": answer.source}
    elif answer.kind == "ebnf":
        body = {"type": "grammar", "grammar": answer.source}
    else:
        schema: Any = json.loads(answer.source) if answer.kind == "json_schema" else {"type": "object"}
        body = {"type": "json_schema", "json_schema": schema}
    tag = {"type": "structural_tag", "format": _with_thinking(body, thinking)}
    return GrammarSpec("structural_tag", json.dumps(tag))
