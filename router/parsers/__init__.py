"""Streaming output parsers: an assistant turn's text -> the typed events of router/chat/events.py.

Two parsers, chained per request: ReasoningParser splits reasoning from
content; ToolCallParser reads tool calls in the content only (markup inside
reasoning is never a call). Both take text in arbitrary pieces and give the
same events, once consecutive deltas of a kind are merged, however the text
was cut. Pure Python: the router never imports torch.

The chat layer picks them from the model's chat template:
detect_tool_format() and detect_reasoning().
"""

from __future__ import annotations

import re

from router.parsers.reasoning import ReasoningParser
from router.parsers.tool_calls import CALL_FORMATS, ToolCallParser

__all__ = [
    "CALL_FORMATS",
    "ReasoningParser",
    "ToolCallParser",
    "detect_reasoning",
    "detect_tool_format",
]

_ENDS_IN_THINK = re.compile(r"<think>\s*\Z")


def detect_tool_format(chat_template_source: str) -> str | None:
    """The tool call format a chat template teaches its model, or None if it has no tool calls.

    "qwen3_coder" when it writes both <tool_call> and <function= (Qwen3-Coder's
    XML calls), "hermes" when it writes <tool_call> (JSON calls).
    """
    if "<tool_call>" not in chat_template_source:
        return None
    return "qwen3_coder" if "<function=" in chat_template_source else "hermes"


def detect_reasoning(chat_template_source: str, rendered_prompt: str) -> tuple[bool, bool]:
    """(the template has thinking at all, the output starts inside reasoning).

    The output starts inside reasoning when the rendered prompt ends with
    <think> and optional whitespace (DeepSeek-R1 and QwQ-style templates open
    the thinking themselves); feed that as ReasoningParser(start_in_reasoning=...).
    """
    has_thinking = "<think>" in chat_template_source
    return has_thinking, bool(_ENDS_IN_THINK.search(rendered_prompt))
