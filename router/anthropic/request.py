"""A Messages API request, checked field by field, as a ChatRequest.

Every error is a 400 invalid_request_error whose message and param name the
field. Sampling ranges are Anthropic's: temperature in [0, 1], top_p in
(0, 1], top_k a count (0: off).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol import GrammarSpec
from router.anthropic.conversation import conversation
from router.anthropic.fields import refuse
from router.anthropic.schemas import ConversationFields, MessagesRequest
from router.anthropic.tools import function_tools, tool_choice
from router.chat.request import ChatRequest
from router.chat.thinking_budget import ThinkingBudget
from router.json_schema_limits import check_enforceable
from router.sampling import SamplingRequest, check_range
from router.text.stop_strings import check_stops

# Anthropic's floor for an extended-thinking budget.
MIN_THINKING_BUDGET = 1024


@dataclass(frozen=True)
class ThinkingChoice:
    # None: whatever the model's template does by default.
    enabled: bool | None
    # display "omitted": thinking blocks carry only their signature.
    show: bool = True
    # type "enabled": budget_tokens, held by the engine.
    budget: ThinkingBudget | None = None


def thinking_choice(thinking: dict[str, Any] | None, max_tokens: int | None) -> ThinkingChoice:
    """disabled -> off, enabled -> on with budget_tokens (checked as
    Anthropic does; the engine ends the thinking there), adaptive or absent
    -> the template's default."""
    if thinking is None:
        return ThinkingChoice(None)
    kind = thinking.get("type")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise refuse("thinking.display", f"must be 'summarized' or 'omitted', got {display!r}")
    show = display != "omitted"
    if kind == "disabled":
        return ThinkingChoice(False)
    if kind == "adaptive":
        return ThinkingChoice(None, show)
    if kind != "enabled":
        raise refuse("thinking.type", f"must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise refuse("thinking.budget_tokens", "thinking of type 'enabled' needs budget_tokens, an integer")
    if budget < MIN_THINKING_BUDGET:
        raise refuse("thinking.budget_tokens", f"must be at least {MIN_THINKING_BUDGET}, got {budget}")
    if max_tokens is not None and budget >= max_tokens:
        raise refuse("thinking.budget_tokens",
                     f"max_tokens ({max_tokens}) must be greater than thinking.budget_tokens ({budget})")
    return ThinkingChoice(True, show, ThinkingBudget(budget))


def answer_format(output_config: dict[str, Any] | None) -> GrammarSpec | None:
    """output_config.format (structured outputs) as the turn's response format."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise refuse("output_config.format.type", "the format must be {\"type\": \"json_schema\", \"schema\": {...}}")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise refuse("output_config.format.schema", "the format needs a schema, a JSON schema object")
    # Anthropic's structured outputs always follow the schema exactly.
    check_enforceable(schema, "output_config.format.schema")
    return GrammarSpec("json_schema", json.dumps(schema))


def _strict_tools(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    """The names of the tools with strict: true, whose calls follow their
    schema (router/chat/tool_grammar.py); such a schema may hold no keyword
    the grammar would drop."""
    strict: set[str] = set()
    for index, tool in enumerate(tools or ()):
        flag = tool.get("strict")
        if flag is not None and not isinstance(flag, bool):
            raise refuse(f"tools[{index}].strict", "strict must be a boolean", "invalid_type")
        if flag:
            check_enforceable(tool.get("input_schema"), f"tools[{index}].input_schema")
            strict.add(tool["name"])
    return frozenset(strict)


def _sampling(req: MessagesRequest, *, stream: bool) -> SamplingRequest:
    if req.max_tokens < 1:
        raise refuse("max_tokens", f"must be at least 1, got {req.max_tokens}")
    check_range(req.temperature, "temperature", 0.0, 1.0)
    check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    if req.top_k is not None and req.top_k < 0:
        raise refuse("top_k", f"must be 0 or more, got {req.top_k}")
    return SamplingRequest(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=check_stops(req.stop_sequences or (), "stop_sequences"),
        # A stream sends message_start once the engine reports the prompt's
        # cache hits, which progress reports carry before the first token.
        report_progress=stream,
    )


def chat_request(req: ConversationFields, *, sampling: SamplingRequest | None = None,
                 thinking: ThinkingChoice | None = None) -> ChatRequest:
    """The prompt-shaping part; count_tokens stops here."""
    if req.mcp_servers:
        raise refuse("mcp_servers", "not supported: this server connects to no MCP server; "
                     "send the tools as custom tools")
    talk = conversation(req.system, req.messages)
    tools = function_tools(req.tools)
    strict = _strict_tools(req.tools)
    choice, parallel = tool_choice(req.tool_choice, tools)
    thinking = thinking or thinking_choice(req.thinking, None)
    return ChatRequest(
        messages=talk.messages,
        images=talk.images,
        sampling=sampling or SamplingRequest(),
        tools=tools,
        tool_choice=choice,
        strict_tools=strict,
        parallel_tool_calls=parallel,
        enable_thinking=thinking.enabled,
        thinking_budget=thinking.budget,
        prefill=talk.prefill,
        response_format=answer_format(req.output_config),
        tool_id_prefix="toolu_",
    )


def messages_request(req: MessagesRequest) -> tuple[ChatRequest, ThinkingChoice]:
    thinking = thinking_choice(req.thinking, req.max_tokens)
    chat = chat_request(req, sampling=_sampling(req, stream=req.stream), thinking=thinking)
    return chat, thinking
