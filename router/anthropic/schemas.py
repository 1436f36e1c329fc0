"""Request bodies of the Messages API, decoded and type-checked by msgspec.

Content blocks stay plain dicts here: they are checked one by one in
router/anthropic/conversation.py, so that an unsupported block type gets a 400
naming its exact place (messages[2].content[1].type) rather than msgspec's
generic union error. Unknown top-level fields are ignored, as Anthropic's
newer fields (service_tier, container, ...) mean nothing here.
"""

from __future__ import annotations

from typing import Any

import msgspec


class InputMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]]


class ConversationFields(msgspec.Struct, kw_only=True):
    """What POST /v1/messages and POST /v1/messages/count_tokens share: all
    that shapes the prompt."""

    messages: list[InputMessage]
    # Anthropic requires it; like every route here, a request without one
    # goes to the most recently used model (docs/serving.md).
    model: str | None = None
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None


class MessagesRequest(ConversationFields, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Accepted and unused (user_id is for Anthropic's abuse detection).
    metadata: dict[str, Any] | None = None


class CountTokensRequest(ConversationFields, kw_only=True):
    pass
