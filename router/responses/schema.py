"""The body of POST /v1/responses (and /v1/responses/input_tokens), decoded
and type-checked by msgspec.

Only the outer types are checked here; items, tools and formats are checked
field by field in router/responses/items.py, tools.py and request_map.py so
that each 400 names the exact field. Unknown fields are ignored, as
OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    # A summary of the thinking; accepted (Codex always sends "auto") but this
    # server returns the thinking itself as reasoning_text, never a summary.
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None
    mode: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    # Obfuscation pads deltas against side channels; it is optional in the
    # API and never added here.
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # Echoed back, otherwise without effect: the prefix cache is automatic
    # and there is no abuse detection to feed.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused unless absent or at their neutral values (request_map.py).
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    prompt: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
