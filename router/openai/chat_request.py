"""A Chat Completions request, checked field by field, as a ChatRequest.

What the engine cannot do gets a 400 naming the field (n > 1, audio output,
a non-zero logit_bias, logprobs); the neutral values of those fields are
accepted, and unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from protocol import GrammarSpec
from router.chat.request import ChatRequest, NamedTool, ToolChoice
from router.http.errors import invalid
from router.openai.params import check_common, check_max_tokens, sampling_request
from router.openai.schemas import ChatCompletionRequest, ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _text_content(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise invalid(f"messages[{index}] ({message.role}) has no content", f"messages[{index}].content")
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        kind = part.get("type")
        if kind != "text":
            raise invalid(f"content part type {kind!r} is not supported here; send text parts",
                          f"{where}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid("a text content part needs a string 'text'", f"{where}.text", "invalid_type")
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    checked = []
    for call_index, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{call_index}]"
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid("a tool call needs function.name", f"{where}.function")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            # Templates print a string as is and a dict as JSON; hand them a
            # dict when the string is JSON so both kinds render alike.
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass
        checked.append({"id": call.get("id"), "type": "function",
                        "function": {"name": function["name"], "arguments": arguments}})
    return checked


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise invalid("'messages' must hold at least one message", "messages")
    rendered = []
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise invalid(
                f"unknown role {message.role!r} in messages[{index}]; expected one of {', '.join(ROLES)}",
                f"messages[{index}].role",
            )
        entry: dict[str, Any] = {
            # OpenAI's "developer" is the system role of newer models.
            "role": "system" if message.role == "developer" else message.role,
            "content": _text_content(message, index),
        }
        if message.tool_calls:
            entry["tool_calls"] = _tool_calls(message.tool_calls, index)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            entry["reasoning_content"] = reasoning
        rendered.append(entry)
    return rendered


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    checked = []
    for index, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise invalid(f"tool type {tool.get('type')!r} is not supported; only function tools are",
                          f"tools[{index}].type")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid("a function tool needs function.name", f"tools[{index}].function.name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid("function.parameters must be a JSON schema object",
                          f"tools[{index}].function.parameters", "invalid_type")
        checked.append({"type": "function", "function": function})
    return checked


def check_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> ToolChoice:
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid(f"'tool_choice' must be auto, none, required or a function, got {choice!r}",
                          "tool_choice")
        if choice == "required" and not tools:
            raise invalid("'tool_choice' is required but no tools were given", "tool_choice")
        return choice
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise invalid("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                      "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return NamedTool(name)


def response_format(value: dict[str, Any] | None) -> GrammarSpec | None:
    if value is None or value.get("type") in (None, "text"):
        return None
    if value["type"] == "json_object":
        return GrammarSpec("json_object")
    if value["type"] == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise invalid("response_format json_schema needs json_schema.schema, an object",
                          "response_format.json_schema.schema")
        return GrammarSpec("json_schema", json.dumps(schema))
    raise invalid(f"response_format type {value['type']!r} is not supported", "response_format.type")


def _refuse_what_we_cannot_do(req: ChatCompletionRequest) -> None:
    if req.logit_bias and any(bias != 0 for bias in req.logit_bias.values()):
        raise invalid("'logit_bias' is not supported (all-zero biases are accepted)", "logit_bias")
    if req.logprobs:
        raise invalid("'logprobs' is not supported yet", "logprobs")
    if req.top_logprobs:
        raise invalid("'top_logprobs' is not supported yet", "top_logprobs")
    if req.audio is not None or (req.modalities and "audio" in req.modalities):
        raise invalid("audio output is not supported", "audio" if req.audio is not None else "modalities")


def thinking_choice(req: ChatCompletionRequest) -> bool | None:
    """enable_thinking from the request (top level or chat_template_kwargs),
    or reasoning_effort "none" turning it off."""
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise invalid(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    kwargs = req.chat_template_kwargs or {}
    if req.enable_thinking is not None:
        return req.enable_thinking
    if "enable_thinking" in kwargs:
        return bool(kwargs["enable_thinking"])
    if req.reasoning_effort == "none":
        return False
    return None


def chat_request(req: ChatCompletionRequest) -> ChatRequest:
    check_common(req)
    _refuse_what_we_cannot_do(req)
    if req.max_completion_tokens is not None:
        max_tokens, max_field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_field = req.max_tokens, "max_tokens"
    check_max_tokens(max_tokens, max_field)
    tools = check_tools(req.tools)
    sampling = sampling_request(req, max_tokens)
    if req.return_progress:
        sampling = replace(sampling, report_progress=True)
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "enable_thinking"}
    return ChatRequest(
        messages=template_messages(req.messages),
        sampling=sampling,
        tools=tools,
        tool_choice=check_tool_choice(req.tool_choice, tools),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        enable_thinking=thinking_choice(req),
        template_kwargs=kwargs,
        response_format=response_format(req.response_format),
    )
