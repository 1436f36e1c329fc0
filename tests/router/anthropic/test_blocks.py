"""Parsed turn events -> Anthropic content blocks and their stream events."""

from __future__ import annotations

import base64
import json

from router.anthropic.blocks import ContentBlocks, WireEvent
from router.anthropic.signature import thinking_signature
from router.chat.events import (
    ContentDelta,
    ParsedEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)


def run(events: list[ParsedEvent], **options: bool) -> tuple[ContentBlocks, list[WireEvent]]:
    blocks = ContentBlocks(**options)
    wire = [w for event in events for w in blocks.feed(event)]
    return blocks, wire + blocks.finish()


def replay(wire: list[WireEvent]) -> list[dict]:
    """Assemble the stream as a client does, to compare with blocks."""
    out: list[dict] = []
    json_parts: dict[int, str] = {}
    for name, data in wire:
        if name == "content_block_start":
            assert data["index"] == len(out)
            out.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = out[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                json_parts[data["index"]] = json_parts.get(data["index"], "") + delta["partial_json"]
        elif name == "content_block_stop" and data["index"] in json_parts:
            out[data["index"]]["input"] = json.loads(json_parts[data["index"]])
    return out


CALL = [ToolCallStart(0, "toolu_a", "get_weather"), ToolCallDelta(0, '{"city": '),
        ToolCallDelta(0, '"Paris"}'), ToolCallEnd(0, "toolu_a", "get_weather", '{"city": "Paris"}')]


def test_thinking_then_text() -> None:
    blocks, wire = run([ReasoningDelta("Let me "), ReasoningDelta("think."), ContentDelta("\n\n"),
                        ContentDelta("Hello"), ContentDelta(" there.")])
    signature = thinking_signature("Let me think.")
    assert blocks.blocks == [{"type": "thinking", "thinking": "Let me think.", "signature": signature},
                             {"type": "text", "text": "\n\nHello there."}]
    assert [(name, data.get("delta", {}).get("type")) for name, data in wire] == [
        ("content_block_start", None), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None), ("content_block_start", None),
        ("content_block_delta", "text_delta"), ("content_block_delta", "text_delta"),
        ("content_block_stop", None)]
    assert wire[0][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert replay(wire) == blocks.blocks
    assert not blocks.has_tool_use


def test_tool_use_after_text() -> None:
    blocks, wire = run([ContentDelta("Checking."), *CALL, ContentDelta("\n")])
    assert blocks.blocks == [{"type": "text", "text": "Checking."},
                             {"type": "tool_use", "id": "toolu_a", "name": "get_weather",
                              "input": {"city": "Paris"}}]
    start = next(data for name, data in wire if name == "content_block_start" and data["index"] == 1)
    assert start["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}
    assert replay(wire) == blocks.blocks and blocks.has_tool_use


def test_whitespace_alone_opens_no_block() -> None:
    blocks, wire = run([ReasoningDelta("\n"), ContentDelta("\n\n")])
    assert blocks.blocks == [] and wire == []


def test_missing_argument_pieces_are_sent_at_the_end() -> None:
    blocks, wire = run([ToolCallStart(0, "toolu_a", "f"), ToolCallDelta(0, '{"a"'),
                        ToolCallEnd(0, "toolu_a", "f", '{"a": 1}')])
    assert replay(wire) == blocks.blocks == [{"type": "tool_use", "id": "toolu_a", "name": "f", "input": {"a": 1}}]


def test_one_tool_use_drops_the_rest() -> None:
    second = [ToolCallStart(1, "toolu_b", "get_weather"), ToolCallDelta(1, "{}"),
              ToolCallEnd(1, "toolu_b", "get_weather", "{}")]
    blocks, wire = run([*CALL, *second], one_tool_use=True)
    assert [b["id"] for b in blocks.blocks] == ["toolu_a"]
    assert replay(wire) == blocks.blocks
    both, _ = run([*CALL, *second])
    assert [b["id"] for b in both.blocks] == ["toolu_a", "toolu_b"]


def test_omitted_thinking_keeps_only_the_signature() -> None:
    blocks, wire = run([ReasoningDelta("secret"), ContentDelta("Answer")], show_thinking=False)
    assert blocks.blocks[0] == {"type": "thinking", "thinking": "", "signature": thinking_signature("secret")}
    assert not any(data.get("delta", {}).get("type") == "thinking_delta" for _, data in wire)
    assert replay(wire) == blocks.blocks


def test_a_call_cut_short_keeps_what_parses() -> None:
    blocks, _ = run([ToolCallStart(0, "toolu_a", "f"), ToolCallDelta(0, '{"a": 1')])
    assert blocks.blocks[0]["input"] == {}
    blocks, _ = run([ToolCallStart(0, "toolu_a", "f"), ToolCallDelta(0, '{"a": 1}')])
    assert blocks.blocks[0]["input"] == {"a": 1}


def test_signatures_are_hmacs_of_the_text() -> None:
    signature = thinking_signature("abc")
    assert len(base64.b64decode(signature)) == 32
    assert signature == thinking_signature("abc") != thinking_signature("abd")
