"""A Chat Completions request, checked field by field, as a ChatRequest.

User messages may carry image_url parts (an object with url and detail, or
the URL as a bare string, as vLLM takes it); they become the request's
ImageRefs (router/chat/image_parts.py). Images anywhere else, and audio or
file parts, get a 400 naming the part.

What the engine cannot do gets a 400 naming the field (audio output, store,
a priority, a verbosity, predicted outputs, web search);
the neutral values of those fields are accepted, and
unknown fields are ignored, as OpenAI-compatible servers do. Thinking
budgets (thinking_budget, reasoning_effort) map as
router/chat/thinking_budget.py says. Legacy
`functions` / `function_call` are read as tools / tool_choice, as OpenAI
does; output constraints come from router/openai/guided.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from router.chat.image_parts import MessageContent, detail_of, image_url
from router.chat.request import ChatRequest, NamedTool, ToolChoice
from router.chat.thinking_budget import ThinkingBudget, effort_budget, given_budget
from router.http.errors import invalid
from router.json_schema_limits import check_enforceable
from router.media.types import ImageRef
from router.openai.guided import chat_constraint
from router.openai.params import (
    chat_logprobs,
    check_common,
    check_max_tokens,
    sampling_request,
)
from router.openai.schemas import ChatCompletionRequest, ChatMessage
from router.text.model_text import RENDERER_ARGUMENTS

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# llama.cpp's refusal, word for word: the final assistant message is the one
# the model continues (or a turn already answered), never two of them.
TWO_ASSISTANTS = "Cannot have 2 or more assistant messages at the end of the list."
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _content(message: ChatMessage, index: int,
             images: list[ImageRef]) -> str | list[dict[str, Any]]:
    """A message's content for the template: its text parts joined, or text
    and image parts when a user message carries images (image_parts.py)."""
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise invalid(f"messages[{index}] ({message.role}) has no content", f"messages[{index}].content")
    if isinstance(content, str):
        return content
    parts = MessageContent(images)
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid("a text content part needs a string 'text'", f"{where}.text", "invalid_type")
            parts.text(text)
        elif kind == "image_url":
            if message.role != "user":
                raise invalid(f"{where} is an image in a {message.role} message; images go in "
                              "user messages only", f"{where}.type")
            parts.image(_image_ref(part.get("image_url"), f"{where}.image_url"))
        elif kind in ("input_audio", "file"):
            raise invalid(f"content part type {kind!r} is not supported: this server reads text "
                          "and images (image_url)", f"{where}.type")
        else:
            raise invalid(f"content part type {kind!r} is not supported here; send text parts "
                          "(and image_url parts in user messages)", f"{where}.type")
    return parts.content()


def _image_ref(value: Any, param: str) -> ImageRef:
    """{"url": ..., "detail": ...}, or the URL as a bare string (as vLLM takes it)."""
    if isinstance(value, str):
        return ImageRef(image_url(value, param), param)
    if not isinstance(value, dict):
        code = "missing_required_parameter" if value is None else "invalid_type"
        raise invalid(f"'{param}' must be an object with 'url' (or the URL as a string)", param, code)
    return ImageRef(image_url(value.get("url"), f"{param}.url"), param,
                    detail_of(value.get("detail"), f"{param}.detail"))


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


def _legacy_call(message: ChatMessage, index: int) -> list[dict[str, Any]] | None:
    """An assistant's legacy function_call as the one tool call it is."""
    call = message.function_call
    if call is None:
        return message.tool_calls
    if message.tool_calls:
        raise invalid("send either tool_calls or function_call", f"messages[{index}].function_call")
    return [{"id": None, "type": "function", "function": call}]


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], tuple[ImageRef, ...]]:
    """The messages for the template, and the images of their image parts in order."""
    if not messages:
        raise invalid("'messages' must hold at least one message", "messages")
    if len(messages) >= 2 and messages[-1].role == messages[-2].role == "assistant":
        raise invalid(TWO_ASSISTANTS, f"messages[{len(messages) - 1}]")
    rendered = []
    images: list[ImageRef] = []
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise invalid(
                f"unknown role {message.role!r} in messages[{index}]; expected one of {', '.join(ROLES)}",
                f"messages[{index}].role",
            )
        # OpenAI's "developer" is the system role of newer models; a legacy
        # "function" message is a tool result.
        role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
        entry: dict[str, Any] = {"role": role, "content": _content(message, index, images)}
        calls = _legacy_call(message, index)
        if calls:
            entry["tool_calls"] = _tool_calls(calls, index)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            entry["reasoning_content"] = reasoning
        rendered.append(entry)
    return rendered, tuple(images)


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
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid("function.strict must be a boolean", f"tools[{index}].function.strict",
                          "invalid_type")
        if strict and parameters is not None:
            check_enforceable(parameters, f"tools[{index}].function.parameters")
        checked.append({"type": "function", "function": function})
    return checked


def _legacy_tools(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """tools and tool_choice, or OpenAI's older functions and function_call
    read as them: a function_call {"name": X} is tool_choice naming X."""
    if req.functions is None and req.function_call is None:
        return req.tools, req.tool_choice
    if req.tools is not None or req.tool_choice is not None:
        field = "functions" if req.functions is not None else "function_call"
        raise invalid("send tools and tool_choice, or the legacy functions and function_call, "
                      "not both", field)
    tools = [{"type": "function", "function": f} for f in req.functions or ()]
    choice: Any = req.function_call
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


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


def _refuse_what_we_cannot_do(req: ChatCompletionRequest) -> None:
    if req.audio is not None or (req.modalities and "audio" in req.modalities):
        raise invalid("audio output is not supported", "audio" if req.audio is not None else "modalities")
    if req.store:
        raise invalid("'store' is not supported: chat completions are not stored here "
                      "(false is accepted; the Responses API stores responses)", "store",
                      "unsupported_parameter")
    if req.verbosity not in (None, "medium"):
        raise invalid("'verbosity' cannot be set for these models ('medium' is accepted)",
                      "verbosity", "unsupported_parameter")
    if req.service_tier not in (None, "auto", "default"):
        raise invalid(f"service tier {req.service_tier!r} is not supported; use 'auto' or "
                      "'default'", "service_tier", "unsupported_parameter")
    if req.prediction is not None:
        raise invalid("predicted outputs ('prediction') are not supported", "prediction",
                      "unsupported_parameter")
    if req.web_search_options is not None:
        raise invalid("web search is not supported", "web_search_options", "unsupported_parameter")
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid("'add_generation_prompt' and 'continue_final_message' contradict each "
                      "other: continuing the final message opens no new turn",
                      "add_generation_prompt")


def thinking_budget(req: ChatCompletionRequest) -> ThinkingBudget | None:
    """The budget the request gives as a count (thinking_budget, llama.cpp's
    thinking_budget_tokens, Qwen's chat_template_kwargs.thinking_budget), else
    its reasoning_effort's (checked by thinking_choice)."""
    kwargs = req.chat_template_kwargs or {}
    for value, param in ((req.thinking_budget, "thinking_budget"),
                         (req.thinking_budget_tokens, "thinking_budget_tokens"),
                         (kwargs.get("thinking_budget"), "chat_template_kwargs.thinking_budget")):
        budget = given_budget(value, param)
        if budget is not None:
            return budget
    return effort_budget(req.reasoning_effort)


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
    given_tools, given_choice = _legacy_tools(req)
    tools = check_tools(given_tools)
    sampling = sampling_request(req, max_tokens, logprobs=chat_logprobs(req))
    if req.return_progress:
        sampling = replace(sampling, report_progress=True)
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "enable_thinking"}
    reserved = sorted(RENDERER_ARGUMENTS & kwargs.keys())
    if reserved:
        raise invalid(f"'chat_template_kwargs' may not set {reserved[0]!r}: the server sets it "
                      "from the request itself", "chat_template_kwargs")
    messages, images = template_messages(req.messages)
    prefill = ""
    if req.continue_final_message:
        prefill, messages = _final_assistant_text(messages), messages[:-1]
    return ChatRequest(
        messages=messages,
        images=images,
        sampling=sampling,
        tools=tools,
        tool_choice=check_tool_choice(given_choice, tools),
        strict_tools=frozenset(t["function"]["name"] for t in tools if t["function"].get("strict") is True),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        enable_thinking=thinking_choice(req),
        thinking_budget=thinking_budget(req),
        template_kwargs=kwargs,
        prefill=prefill,
        response_format=chat_constraint(req),
        add_generation_prompt=req.add_generation_prompt is not False,
    )


def _final_assistant_text(messages: list[dict[str, Any]]) -> str:
    """continue_final_message: the final message must be the assistant's
    text, which the model goes on from (and which is not sent back)."""
    final = messages[-1]
    where = f"messages[{len(messages) - 1}]"
    if final["role"] != "assistant":
        raise invalid("'continue_final_message' needs the final message to be the assistant's",
                      f"{where}.role")
    if final.get("tool_calls") or not final["content"]:
        raise invalid("'continue_final_message' needs a final assistant message with text "
                      "and no tool calls", f"{where}.content")
    if len(messages) < 2:
        raise invalid("'continue_final_message' needs a message before the assistant's",
                      "messages")
    return final["content"]
