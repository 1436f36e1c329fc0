"""Parsed events as output items and stream events, in the documented order."""

from __future__ import annotations

from router.chat.events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from router.responses.output import OutputAssembler
from router.responses.tools import tool_set


def run(events: list, *, incomplete: bool = False, tools: list | None = None):  # type: ignore[no-untyped-def]
    assembler = OutputAssembler(tool_set(tools or []))
    out = [e for event in events for e in assembler.feed(event)]
    out.extend(assembler.finish(incomplete=incomplete))
    return assembler.items, out


def test_reasoning_then_text() -> None:
    items, events = run([ReasoningDelta("Think"), ReasoningDelta("ing."), ContentDelta("\n\n"),
                         ContentDelta("Hello"), ContentDelta("!")])
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]
    reasoning, message = items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "\n\nHello!", "annotations": [],
                                   "logprobs": []}]
    assert message["role"] == "assistant" and message["status"] == "completed"
    added = events[0]
    assert added["output_index"] == 0 and added["item"]["status"] == "in_progress"
    assert events[7]["output_index"] == 1 and events[7]["item"]["content"] == []
    assert events[9] == {"type": "response.output_text.delta", "item_id": message["id"], "output_index": 1,
                         "content_index": 0, "delta": "\n\nHello", "logprobs": []}


def test_calls_with_a_namespace() -> None:
    crm = {"type": "namespace", "name": "crm", "description": "",
           "tools": [{"type": "function", "name": "lookup"}]}
    items, events = run([
        ContentDelta("\n"),
        ToolCallStart(0, "call_a", "crm__lookup"), ToolCallDelta(0, '{"id": '), ToolCallDelta(0, "1}"),
        ToolCallEnd(0, "call_a", "crm__lookup", '{"id": 1}'),
        ToolCallStart(1, "call_b", "crm__lookup"), ToolCallEnd(1, "call_b", "crm__lookup", "{}"),
    ], tools=[crm])
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.done", "response.output_item.done",
    ]
    first, second = items
    assert first == {"id": first["id"], "type": "function_call", "call_id": "call_a", "name": "lookup",
                     "namespace": "crm", "arguments": '{"id": 1}', "status": "completed"}
    assert first["id"].startswith("fc_") and second["call_id"] == "call_b"
    assert events[0]["item"]["arguments"] == "" and events[0]["item"]["status"] == "in_progress"
    assert events[3]["arguments"] == '{"id": 1}' and events[6]["output_index"] == 1


def test_the_item_cut_short_is_incomplete() -> None:
    items, events = run([ReasoningDelta("Still thinking")], incomplete=True)
    (reasoning,) = items
    assert reasoning["status"] == "incomplete"
    assert events[-1]["item"]["status"] == "incomplete"


def test_a_finished_turn_always_has_a_message() -> None:
    items, _ = run([ReasoningDelta("Nothing to say.")])
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[1]["content"] == [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
