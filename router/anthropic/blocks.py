"""A turn's parsed events as Anthropic content blocks.

One assembler serves both answers: it yields the stream's block events
(content_block_start / content_block_delta / content_block_stop) and keeps
the finished blocks for the whole message, so a streamed message and a
non-streamed one always hold the same content.

A new block opens whenever the kind of output changes (thinking, text,
tool_use). Stretches of whitespace alone never open a block (the newlines
between </think> and the answer, or between two tool calls): they are held
and prepended if more of the same kind follows, dropped otherwise. A thinking
block gets its signature (one signature_delta) just before it stops.
"""

from __future__ import annotations

import json
from typing import Any

from router.anthropic.signature import thinking_signature
from router.chat.events import (
    ContentDelta,
    ParsedEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)

# (SSE event name, its data)
WireEvent = tuple[str, dict[str, Any]]


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object tool_use.input must be."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _start(index: int, block: dict[str, Any]) -> WireEvent:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": dict(block)}


def _delta(index: int, delta: dict[str, Any]) -> WireEvent:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


class ContentBlocks:
    def __init__(self, *, show_thinking: bool = True, one_tool_use: bool = False):
        self.blocks: list[dict[str, Any]] = []
        self._show_thinking = show_thinking
        # disable_parallel_tool_use: calls after the first are dropped.
        self._one_tool_use = one_tool_use
        self._open: str | None = None  # the kind of the open block (the last one)
        self._held_kind: str | None = None
        self._held = ""
        self._thinking: list[str] = []
        self._pieces: dict[int, list[str]] = {}  # call index -> argument pieces streamed
        self._call_block: dict[int, int] = {}  # call index -> block index
        self._dropped: set[int] = set()

    @property
    def has_tool_use(self) -> bool:
        return bool(self._call_block)

    def feed(self, event: ParsedEvent) -> list[WireEvent]:
        if isinstance(event, ReasoningDelta):
            return self._text("thinking", event.text)
        if isinstance(event, ContentDelta):
            return self._text("text", event.text)
        if isinstance(event, ToolCallStart):
            return self._call_start(event)
        if isinstance(event, ToolCallDelta):
            return self._call_delta(event)
        return self._call_end(event)

    def finish(self) -> list[WireEvent]:
        """Close the open block; whitespace still held is dropped."""
        self._held_kind, self._held = None, ""
        return self._close()

    # ---- thinking and text -----------------------------------------------------

    def _text(self, kind: str, text: str) -> list[WireEvent]:
        if not text:
            return []
        if self._open == kind:
            self._held_kind, self._held = None, ""
            return self._append(kind, text)
        if not text.strip():
            if self._held_kind != kind:
                self._held_kind, self._held = kind, ""
            self._held += text
            return []
        if self._held_kind == kind:
            text = self._held + text
        self._held_kind, self._held = None, ""
        out = self._close()
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
            else {"type": "text", "text": ""}
        self.blocks.append(block)
        self._open = kind
        out.append(_start(len(self.blocks) - 1, block))
        out.extend(self._append(kind, text))
        return out

    def _append(self, kind: str, text: str) -> list[WireEvent]:
        index = len(self.blocks) - 1
        block = self.blocks[index]
        if kind == "text":
            block["text"] += text
            return [_delta(index, {"type": "text_delta", "text": text})]
        self._thinking.append(text)
        if not self._show_thinking:
            return []
        block["thinking"] += text
        return [_delta(index, {"type": "thinking_delta", "thinking": text})]

    def _close(self) -> list[WireEvent]:
        if self._open is None:
            return []
        index = len(self.blocks) - 1
        block = self.blocks[index]
        out: list[WireEvent] = []
        if self._open == "thinking":
            block["signature"] = thinking_signature("".join(self._thinking))
            self._thinking = []
            out.append(_delta(index, {"type": "signature_delta", "signature": block["signature"]}))
        elif self._open == "tool_use" and not block["input"]:
            # Cut off before the call ended (max_tokens): keep what parses.
            call = next(c for c, b in self._call_block.items() if b == index)
            block["input"] = tool_input("".join(self._pieces[call]))
        self._open = None
        out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return out

    # ---- tool calls ----------------------------------------------------------------

    def _call_start(self, event: ToolCallStart) -> list[WireEvent]:
        if self._one_tool_use and self._call_block:
            self._dropped.add(event.index)
            return []
        self._held_kind, self._held = None, ""
        out = self._close()
        block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
        self.blocks.append(block)
        self._open = "tool_use"
        self._call_block[event.index] = len(self.blocks) - 1
        self._pieces[event.index] = []
        out.append(_start(len(self.blocks) - 1, block))
        return out

    def _is_open(self, call: int) -> bool:
        return self._open == "tool_use" and self._call_block.get(call) == len(self.blocks) - 1

    def _call_delta(self, event: ToolCallDelta) -> list[WireEvent]:
        if event.index in self._dropped or event.index not in self._pieces or not event.arguments:
            return []
        self._pieces[event.index].append(event.arguments)
        if not self._is_open(event.index):
            return []
        return [_delta(len(self.blocks) - 1, {"type": "input_json_delta", "partial_json": event.arguments})]

    def _call_end(self, event: ToolCallEnd) -> list[WireEvent]:
        if event.index in self._dropped or event.index not in self._call_block:
            return []
        out: list[WireEvent] = []
        streamed = "".join(self._pieces[event.index])
        # The pieces should add up to the arguments; send what they missed.
        if self._is_open(event.index) and event.arguments.startswith(streamed) \
                and len(event.arguments) > len(streamed):
            out.extend(self._call_delta(ToolCallDelta(event.index, event.arguments[len(streamed):])))
        self.blocks[self._call_block[event.index]]["input"] = tool_input(event.arguments)
        if self._is_open(event.index):
            out.extend(self._close())
        return out
