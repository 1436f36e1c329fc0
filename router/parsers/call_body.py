"""One tool call's text after its opening tag, read by a format's state machine.

A format (hermes.py, qwen3_coder.py) subclasses CallBody and writes its
states as methods `state(text, i) -> next index`; CallBody runs them over
each piece, matches tags that may be cut across pieces, and turns the way a
call ends into a BodyStep the content scanner (tool_calls.py) acts on:

- CLOSED: the closing tag ended the call; the leftover text follows it.
- ENDED: after the header was announced, text broke the call's structure
  (or the stream ended): the call ends with the arguments received so far,
  and the leftover, from the offending character on, is content again.
- BROKEN: the header never completed (no parsable name): nothing was
  announced, and everything after the opening tag is scanned as content.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, ClassVar

from router.chat.events import ParsedEvent, ToolCallDelta, ToolCallEnd, ToolCallStart
from router.parsers.json_scan import Malformed

State = Callable[[str, int], int]
TagHandler = Callable[[str, int], None]

_SPACE = re.compile(r"\s*")


class Outcome(Enum):
    CLOSED = auto()
    ENDED = auto()
    BROKEN = auto()


@dataclass(slots=True)
class BodyStep:
    """What one piece did to a call. leftover is a suffix of everything fed to the body."""

    events: list[ParsedEvent] = field(default_factory=list)
    outcome: Outcome | None = None
    leftover: str = ""


class CallBody(ABC):
    """The text of one call after its opening tag, up to and including its closing tag."""

    open_tag: ClassVar[str] = "<tool_call>"
    close_tag: ClassVar[str] = "</tool_call>"

    def __init__(self, index: int, call_id: str, schemas: Mapping[str, dict[str, Any]]) -> None:
        self.index = index
        self.id = call_id
        self.name: str | None = None  # set when the header completes (ToolCallStart is sent)
        self._schemas = schemas
        self._state: State  # set by the format's __init__: its first state
        self._arguments: list[str] = []
        self._early: list[str] = []  # argument text written before the name, sent right after it
        self._raw: list[str] = []  # everything fed before the header completed, given back if it breaks
        self._held = ""  # the start of a tag being matched; given back if it turns out to be junk
        self._tags: Mapping[str, TagHandler] = {}
        self._events: list[ParsedEvent] = []
        self._outcome: Outcome | None = None
        self._leftover = ""

    @abstractmethod
    def _finish_arguments(self) -> None:
        """Send what the arguments still need before ToolCallEnd (the call is ending)."""

    def feed(self, text: str) -> BodyStep:
        if self.name is None:
            self._raw.append(text)
        try:
            i = 0
            while i < len(text) and self._outcome is None:
                i = self._state(text, i)
        except Malformed as broke:
            if self.name is None:
                return self._take(Outcome.BROKEN, "".join(self._raw))
            self._end()
            return self._take(Outcome.ENDED, self._held + text[broke.at:])
        return self._take(self._outcome, self._leftover)

    def finish(self) -> BodyStep:
        """The stream ended inside the call."""
        if self.name is None:
            return self._take(Outcome.BROKEN, "".join(self._raw))
        self._end()
        return self._take(Outcome.ENDED, "")

    def cut(self) -> list[ParsedEvent]:
        """The token limit ended the stream inside the call: its end with the
        arguments as generated, nothing invented or closed (no events when
        the header never completed: there is no call to report)."""
        if self.name is None:
            return []
        self._finish_cut_arguments()
        self._events.append(ToolCallEnd(self.index, self.id, self.name, "".join(self._arguments),
                                        complete=False))
        return self._take(None, "").events

    @abstractmethod
    def _finish_cut_arguments(self) -> None:
        """Send argument text still held when the stream is cut: as written, nothing closed."""

    # Events.

    def _start(self, name: str) -> None:
        self.name = name
        self._raw.clear()
        self._events.append(ToolCallStart(self.index, self.id, name))
        early, self._early = "".join(self._early), []
        self._send(early)

    def _send(self, piece: str) -> None:
        """Argument text, in order; held back until the name is known."""
        if not piece:
            return
        if self.name is None:
            self._early.append(piece)
            return
        self._arguments.append(piece)
        self._events.append(ToolCallDelta(self.index, piece))

    def _end(self) -> None:
        assert self.name is not None
        self._finish_arguments()
        if not self._arguments:
            self._send("{}")  # no arguments written: the empty object, never an empty text
        self._events.append(ToolCallEnd(self.index, self.id, self.name, "".join(self._arguments)))

    def _closed(self, text: str, at: int) -> None:
        """The closing tag ended just before text[at] (a tag handler)."""
        if self.name is None:
            raise Malformed(at)
        self._end()
        self._outcome = Outcome.CLOSED
        self._leftover = text[at:]

    def _take(self, outcome: Outcome | None, leftover: str) -> BodyStep:
        events, self._events = self._events, []
        return BodyStep(events, outcome, leftover)

    # Shared states.

    @staticmethod
    def _skip_space(text: str, i: int) -> int:
        return _SPACE.match(text, i).end()  # \s* always matches, maybe empty

    def _expect(self, tags: Mapping[str, TagHandler], text: str, i: int) -> int:
        """Match one of tags from text[i]; its handler runs once it is complete."""
        self._tags = tags
        self._state = self._in_tag
        return self._in_tag(text, i)

    def _in_tag(self, text: str, i: int) -> int:
        held = self._held + text[i]
        if not any(tag.startswith(held) for tag in self._tags):
            raise Malformed(i)
        handler = self._tags.get(held)
        if handler is None:
            self._held = held
        else:
            self._held = ""
            handler(text, i + 1)
        return i + 1
