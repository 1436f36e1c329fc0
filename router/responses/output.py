"""A turn's parsed events as Responses output items and stream events.

One OutputAssembler serves both ways of answering: a streamed response sends
the events it returns; a whole response only keeps its `items`. Items open
and close as the output moves between kinds, with the events in the order
the API documents:

    reasoning  output_item.added, content_part.added (reasoning_text),
               reasoning_text.delta..., reasoning_text.done,
               content_part.done, output_item.done
    message    output_item.added, content_part.added (output_text),
               output_text.delta..., output_text.done,
               content_part.done, output_item.done
    call       output_item.added, function_call_arguments.delta...,
               function_call_arguments.done, output_item.done

Events are plain dicts without `sequence_number`, which the stream adds.

An output_text part always has `logprobs` ([] unless the request included
message.output_text.logprobs; then router/responses/logprobs.py says which
tokens each text delta lists, and the part and output_text.done list all
of its text's).
"""

from __future__ import annotations

from typing import Any

from router.chat.events import (
    ContentDelta,
    ParsedEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from router.responses import ids
from router.responses.logprobs import Entry, OutputLogprobs, delta_shape
from router.responses.tools import ToolSet

Event = dict[str, Any]


class OutputAssembler:
    def __init__(self, tools: ToolSet, logprobs: OutputLogprobs | None = None):
        self.tools = tools
        self._logprobs = logprobs
        # The open message's entries so far (with logprobs asked for).
        self._entries: list[Entry] = []
        self.items: list[dict[str, Any]] = []
        # Output index of each item, by item id.
        self._index: dict[str, int] = {}
        # The reasoning or message item being written, and its text so far.
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []
        # Whitespace between items (after </think>, between tool calls) that
        # opens no message unless real text follows it.
        self._pending_space = ""
        # Calls being written, by the parser's call index.
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, event: ParsedEvent) -> list[Event]:
        if isinstance(event, ReasoningDelta):
            return self._write("reasoning", event.text)
        if isinstance(event, ContentDelta):
            return self._content(event.text)
        if self._logprobs is not None and isinstance(event, ToolCallStart | ToolCallDelta | ToolCallEnd):
            self._logprobs.drop()
        if isinstance(event, ToolCallStart):
            return self._start_call(event)
        if isinstance(event, ToolCallDelta):
            call = self._calls[event.index]
            call["arguments"] += event.arguments
            return [self._event("response.function_call_arguments.delta", call,
                                delta=event.arguments)]
        return self._end_call(event)

    def finish(self, incomplete: bool) -> list[Event]:
        """Close what is still open; the item cut short by the token limit is
        `incomplete`. A finished turn without a message or a call gets an
        empty message, so that clients always find the answer's text."""
        status = "incomplete" if incomplete else "completed"
        events = self._close(status)
        for index in list(self._calls):
            events.extend(self._end_call(None, index, status))
        if not incomplete and not any(item["type"] in ("message", "function_call") for item in self.items):
            events.extend(self._open_item("message"))
            events.extend(self._close("completed"))
        return events

    # ---- text items -----------------------------------------------------------

    def _content(self, text: str) -> list[Event]:
        if self._open is None or self._open["type"] != "message":
            if not (self._pending_space + text).strip():
                self._pending_space += text
                return []
            text, self._pending_space = self._pending_space + text, ""
        return self._write("message", text)

    def _write(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events.extend(self._close("completed"))
            events.extend(self._open_item(kind))
        if text and kind == "reasoning":
            self._text.append(text)
            events.append(self._part_event("response.reasoning_text.delta", delta=text))
        elif text:
            opens = not self._text
            self._text.append(text)
            entries = self._logprobs.take(text, opens) if self._logprobs is not None else []
            self._entries.extend(entries)
            events.append(self._part_event("response.output_text.delta", delta=text,
                                           logprobs=delta_shape(entries)))
        return events

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item: dict[str, Any] = {"id": ids.new_id(ids.REASONING), "type": "reasoning",
                                    "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"id": ids.new_id(ids.MESSAGE), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
        self._open, self._text, self._entries = item, [], []
        added = {"type": "response.output_item.added", "output_index": self._add(item),
                 "item": _copy(item)}
        return [added, self._part_event("response.content_part.added", part=self._part(""))]

    def _part(self, text: str) -> dict[str, Any]:
        assert self._open is not None
        if self._open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": list(self._entries)}

    def _part_event(self, kind: str, **fields: Any) -> Event:
        assert self._open is not None
        event: Event = {"type": kind, "item_id": self._open["id"],
                        "output_index": self._index[self._open["id"]], "content_index": 0, **fields}
        if kind == "response.output_text.done":
            event["logprobs"] = delta_shape(self._entries)
        return event

    def _close(self, status: str) -> list[Event]:
        if self._open is None:
            return []
        text = "".join(self._text)
        done = ("response.reasoning_text.done" if self._open["type"] == "reasoning"
                else "response.output_text.done")
        events = [self._part_event(done, text=text),
                  self._part_event("response.content_part.done", part=self._part(text))]
        self._open["content"] = [self._part(text)]
        self._open["status"] = status
        events.append({"type": "response.output_item.done",
                       "output_index": self._index[self._open["id"]], "item": _copy(self._open)})
        self._open, self._text, self._entries = None, [], []
        return events

    # ---- function calls ---------------------------------------------------------

    def _start_call(self, event: ToolCallStart) -> list[Event]:
        events = self._close("completed")
        self._pending_space = ""
        namespace, name = self.tools.origin(event.name)
        call: dict[str, Any] = {"id": ids.new_id(ids.FUNCTION_CALL), "type": "function_call",
                                "call_id": event.id, "name": name, "arguments": "",
                                "status": "in_progress"}
        if namespace is not None:
            call["namespace"] = namespace
        self._calls[event.index] = call
        events.append({"type": "response.output_item.added", "output_index": self._add(call),
                       "item": _copy(call)})
        return events

    def _end_call(self, event: ToolCallEnd | None, index: int | None = None,
                  status: str = "completed") -> list[Event]:
        if event is not None:
            index = event.index
        assert index is not None
        call = self._calls.pop(index, None)
        if call is None:
            return []
        if event is not None:
            # The parser's whole arguments are the truth (deltas may be cut
            # differently); they are the deltas joined in every parser we have.
            call["arguments"] = event.arguments
            if not event.complete:
                status = "incomplete"  # cut by the token limit
        call["status"] = status
        return [self._event("response.function_call_arguments.done", call, arguments=call["arguments"]),
                {"type": "response.output_item.done", "output_index": self._index[call["id"]],
                 "item": _copy(call)}]

    def _event(self, kind: str, item: dict[str, Any], **fields: Any) -> Event:
        return {"type": kind, "item_id": item["id"], "output_index": self._index[item["id"]], **fields}

    def _add(self, item: dict[str, Any]) -> int:
        self._index[item["id"]] = len(self.items)
        self.items.append(item)
        return self._index[item["id"]]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    # Events carry the item as it was then; later changes must not reach them.
    return {key: (list(value) if isinstance(value, list) else value) for key, value in item.items()}
