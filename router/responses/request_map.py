"""A Responses request, checked field by field, as a ChatRequest plus what
the response object echoes back.

Mapping: `input` items (after the stored conversation of
previous_response_id) and `instructions` -> template messages
(history.py), their input_image parts -> the request's images; tools and tool_choice -> function tools (tools.py);
text.format -> the response_format grammar; max_output_tokens, temperature
and top_p -> sampling; reasoning.effort -> a thinking budget ("none" and
"minimal" turn thinking off; router/chat/thinking_budget.py's table);
include "message.output_text.logprobs" asks the engine for each token's raw
log probability and top_logprobs (0..20) alternatives, as OpenAI does:
top_logprobs without that include returns none (router/responses/logprobs.py
says which tokens each output_text lists).

Refused with a 400 naming the field: background, conversation,
context_management, prompt (templates), moderation, hosted tools,
truncation "auto", service tiers and verbosities other than the default.
Their neutral values are accepted, and unknown fields are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol import MAX_TOP_LOGPROBS, GrammarSpec
from router.chat.request import ChatRequest
from router.chat.thinking_budget import effort_budget
from router.http.errors import invalid
from router.json_schema_limits import check_enforceable
from router.responses.history import conversation_images, template_messages
from router.responses.items import canonical_input
from router.responses.schema import ResponsesRequest
from router.responses.store import MissingResponse, ResponseStore
from router.responses.tools import ToolSet, tool_choice, tool_set
from router.sampling import SamplingRequest, check_range

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
METADATA_MAX_KEYS = 16
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True)
class ResponsePlan:
    chat: ChatRequest
    tools: ToolSet
    # This request's own input items; the conversation before them is
    # `history` (from previous_response_id).
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]
    # Request fields the response object carries back (router/responses/response.py).
    echo: dict[str, Any]
    store: bool
    stream: bool


def build_plan(req: ResponsesRequest, store: ResponseStore) -> ResponsePlan:
    _refuse_what_we_cannot_do(req)
    check_range(req.temperature, "temperature", 0.0, 2.0)
    check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    check_range(req.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise invalid(f"'max_output_tokens' must be at least 1, got {req.max_output_tokens}",
                      "max_output_tokens")
    _check_metadata(req.metadata)
    history = _history(req.previous_response_id, store)
    input_items = canonical_input(req.input)
    tools = tool_set(req.tools)
    choice = tool_choice(req.tool_choice, tools)
    messages = template_messages([*history, *input_items], req.instructions, tools)
    if not any(m["role"] != "system" for m in messages):
        raise invalid("'input' must hold at least one item besides instructions", "input",
                      "missing_required_parameter")
    chat = ChatRequest(
        messages=messages,
        images=conversation_images(history, input_items),
        sampling=SamplingRequest(max_tokens=req.max_output_tokens, temperature=req.temperature,
                                 top_p=req.top_p, logprobs=_logprobs(req)),
        tools=tools.chat_tools,
        tool_choice=choice,
        strict_tools=tools.strict,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        enable_thinking=_thinking(req),
        thinking_budget=effort_budget(req.reasoning.effort if req.reasoning is not None else None),
        response_format=_text_format(req),
    )
    return ResponsePlan(chat, tools, input_items, history, _echo(req), req.store is not False,
                        bool(req.stream))


def _refuse_what_we_cannot_do(req: ResponsesRequest) -> None:
    if req.background:
        raise invalid("background responses are not supported; stream the response instead",
                      "background")
    if req.conversation is not None:
        raise invalid("conversations are not supported; continue a response with "
                      "previous_response_id", "conversation")
    if req.context_management:
        raise invalid("context management (compaction) is not supported", "context_management")
    if req.prompt is not None:
        raise invalid("prompt templates are not supported; send instructions and input", "prompt")
    if req.moderation is not None:
        raise invalid("moderation is not supported", "moderation")
    if req.truncation not in (None, "disabled"):
        raise invalid("only truncation 'disabled' is supported: a prompt too long for the context "
                      "is refused, never cut", "truncation")
    if req.service_tier not in (None, "auto", "default"):
        raise invalid(f"service tier {req.service_tier!r} is not supported; use 'auto' or 'default'",
                      "service_tier")
    verbosity = req.text.verbosity if req.text is not None else None
    if verbosity not in (None, "medium"):
        raise invalid("verbosity cannot be set for these models ('medium' is accepted)", "text.verbosity")


def _logprobs(req: ResponsesRequest) -> int:
    """SamplingRequest.logprobs: -1 unless the output_text's are included."""
    if LOGPROBS_INCLUDE not in (req.include or []):
        return -1
    return req.top_logprobs or 0


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > METADATA_MAX_KEYS:
        raise invalid(f"'metadata' may hold at most {METADATA_MAX_KEYS} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise invalid("metadata keys are strings of at most 64 characters and values strings of "
                          "at most 512", f"metadata.{key}")


def _history(previous_id: str | None, store: ResponseStore) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    try:
        return store.conversation(previous_id)
    except MissingResponse as missing:
        message = f"Previous response with id '{previous_id}' not found."
        if missing.response_id != previous_id:
            message += (f" Its conversation goes back to response '{missing.response_id}', which is no "
                        "longer stored (the server keeps the most recently used responses within "
                        "--response-store-max-records and --response-store-max-mib).")
        raise invalid(message, "previous_response_id", "previous_response_not_found") from None


def _thinking(req: ResponsesRequest) -> bool | None:
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None and effort not in REASONING_EFFORTS:
        raise invalid(f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}",
                      "reasoning.effort")
    return False if effort == "none" else None


def _text_format(req: ResponsesRequest) -> GrammarSpec | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return GrammarSpec("json_object")
    if fmt["type"] == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise invalid("text.format json_schema needs 'schema', a JSON schema object",
                          "text.format.schema")
        if fmt.get("strict") is True:
            check_enforceable(schema, "text.format.schema")
        return GrammarSpec("json_schema", json.dumps(schema))
    raise invalid(f"text.format type {fmt['type']!r} is not supported; use text, json_object or "
                  "json_schema", "text.format.type")


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    reasoning = req.reasoning
    text = req.text
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": reasoning.summary if reasoning else None},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.store is not False,
        "text": {"format": (text.format if text and text.format else {"type": "text"}),
                 "verbosity": "medium"},
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        "tools": req.tools or [],
        "top_logprobs": req.top_logprobs or 0,
        "truncation": "disabled",
        "user": req.user,
    }
