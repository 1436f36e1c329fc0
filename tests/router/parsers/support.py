"""Run a parser over one text cut three ways and insist on the same events.

Every test goes through here: the text whole, one character at a time, and
at random cut points (seeded), so a parser that decides anything from where
a piece happens to end fails.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterable, Sequence

from router.chat.events import (
    ContentDelta,
    ParsedEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from router.parsers import ReasoningParser, ToolCallParser

ID = re.compile(r"call_[A-Za-z0-9]{24}")


def cuttings(text: str, seed: int = 0) -> list[list[str]]:
    """The text whole, one character at a time, and at random cut points (pieces of 1 to 8)."""
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < len(text):
        bounds.append(min(len(text), bounds[-1] + rng.randint(1, 8)))
    return [[text], list(text), [text[a:b] for a, b in itertools.pairwise(bounds)]]


def merged(events: Iterable[ParsedEvent]) -> list[ParsedEvent]:
    """Consecutive deltas of one kind (and one call) joined into one."""
    out: list[ParsedEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + event.text)
        elif isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == event.index:
            out[-1] = ToolCallDelta(event.index, last.arguments + event.arguments)
        else:
            out.append(event)
    return out


def check_calls(events: Sequence[ParsedEvent]) -> None:
    """Each call: Start, Deltas, End, in index order; End repeats the deltas; ids unique and well formed."""
    open_call: ToolCallStart | None = None
    pieces: list[str] = []
    ids: set[str] = set()
    expected_index = 0
    for event in events:
        assert not (isinstance(event, ContentDelta | ReasoningDelta) and event.text == ""), "empty delta"
        if isinstance(event, ToolCallStart):
            assert open_call is None, "a call started inside another"
            assert event.index == expected_index
            assert ID.fullmatch(event.id) and event.id not in ids
            ids.add(event.id)
            open_call, pieces = event, []
        elif isinstance(event, ToolCallDelta):
            assert open_call is not None and event.index == open_call.index
            pieces.append(event.arguments)
        elif isinstance(event, ToolCallEnd):
            assert open_call is not None
            assert (event.index, event.id, event.name) == (open_call.index, open_call.id, open_call.name)
            assert event.arguments == "".join(pieces)
            open_call = None
            expected_index += 1
        else:
            assert open_call is None, "text inside a call"
    assert open_call is None, "a call never ended"


def without_ids(events: Sequence[ParsedEvent]) -> list[ParsedEvent]:
    """Ids are random: replace them by the call's index to compare runs."""
    out: list[ParsedEvent] = []
    for event in events:
        if isinstance(event, ToolCallStart):
            event = ToolCallStart(event.index, f"id{event.index}", event.name)
        elif isinstance(event, ToolCallEnd):
            event = ToolCallEnd(event.index, f"id{event.index}", event.name, event.arguments)
        out.append(event)
    return out


def same_every_way(run: Callable[[list[str]], list[ParsedEvent]], text: str) -> list[ParsedEvent]:
    results = []
    for pieces in cuttings(text):
        events = run(pieces)
        check_calls(events)
        results.append(without_ids(merged(events)))
    assert results[1] == results[0], "one character at a time differs from whole"
    assert results[2] == results[0], "random cut points differ from whole"
    return results[0]


def tool_events(text: str, fmt: str = "hermes", tools: list[dict] | None = None, prefill: str = "") -> list[ParsedEvent]:
    def run(pieces: list[str]) -> list[ParsedEvent]:
        parser = ToolCallParser(fmt, tools, prefill=prefill)
        events = [event for piece in pieces for event in parser.feed(piece)]
        return events + parser.flush()

    return same_every_way(run, text)


def reasoning_events(text: str, *, start_in_reasoning: bool = False) -> list[ParsedEvent]:
    def run(pieces: list[str]) -> list[ParsedEvent]:
        parser = ReasoningParser(start_in_reasoning=start_in_reasoning)
        events: list[ParsedEvent] = [event for piece in pieces for event in parser.feed(piece)]
        return events + parser.flush()

    return same_every_way(run, text)


def chained_events(text: str, fmt: str = "hermes", *, start_in_reasoning: bool = False) -> list[ParsedEvent]:
    """Reasoning first, then tool calls over the content only, as the chat layer chains them."""

    def run(pieces: list[str]) -> list[ParsedEvent]:
        reasoning = ReasoningParser(start_in_reasoning=start_in_reasoning)
        calls = ToolCallParser(fmt)
        events: list[ParsedEvent] = []
        for piece in [*pieces, None]:
            split = reasoning.feed(piece) if piece is not None else reasoning.flush()
            for event in split:
                events += calls.feed(event.text) if isinstance(event, ContentDelta) else [event]
        return events + calls.flush()

    return same_every_way(run, text)


def content(events: Sequence[ParsedEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def calls(events: Sequence[ParsedEvent]) -> list[tuple[str, str]]:
    """(name, arguments) of each ended call."""
    return [(e.name, e.arguments) for e in events if isinstance(e, ToolCallEnd)]
