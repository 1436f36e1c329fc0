"""The typed pieces an assistant turn's output is split into.

Parsers (router/parsers/) turn generated text into these; each API front-end
maps them onto its own wire format (Chat Completions deltas, Anthropic content
blocks, Responses output items).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Text of the model's thinking (inside <think>...</think>)."""

    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Text of the answer."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call opened: its index within the turn (0, 1, ...), its id and
    the function's name. Its arguments follow as ToolCallDelta pieces."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a call's arguments, a JSON object text; the pieces of one
    call concatenate to ToolCallEnd.arguments."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    id: str
    name: str
    arguments: str
    # False when the token limit cut the call: arguments are what was
    # generated, possibly not a whole JSON object (or "").
    complete: bool = True


ParsedEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallDelta | ToolCallEnd
