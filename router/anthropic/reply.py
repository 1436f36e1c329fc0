"""The Message object: id, stop reason and usage in Anthropic's terms."""

from __future__ import annotations

import uuid
from typing import Any

from router.chat.turn import TurnRun


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def stop_reason(run: TurnRun, has_tool_use: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    generation = run.generation
    reason = generation.finish_reason
    if generation.stop_string is not None:
        return "stop_sequence", generation.stop_string
    if reason == "length":
        # Ours says "length" for both; Anthropic tells max_tokens from a full context.
        asked = run.prepared.request.sampling.max_tokens
        if asked is not None and generation.completion_tokens >= asked:
            return "max_tokens", None
        return "model_context_window_exceeded", None
    if has_tool_use:
        return "tool_use", None
    return "end_turn", None


def usage(run: TurnRun) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from
    input_tokens: the prompt is input_tokens + cache_read_input_tokens (+
    cache_creation_input_tokens, always 0: caching here is automatic and free)."""
    generation = run.generation
    cached = generation.cached_tokens
    return {
        "input_tokens": generation.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": generation.completion_tokens,
    }


def message(message_id: str, model: str, content: list[dict[str, Any]], run: TurnRun,
            *, stop: tuple[str, str | None] | None) -> dict[str, Any]:
    """The Message object; stop None for message_start's (no reason yet)."""
    reason, sequence = stop if stop is not None else (None, None)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(run),
    }
