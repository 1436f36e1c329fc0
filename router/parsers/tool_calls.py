"""Tool calls out of an answer's content, streamed.

The parser scans content for a format's opening tag and hands each call's
text to that format's CallBody (hermes.py, qwen3_coder.py). The rules that
keep ordinary text ordinary:

- An opening tag counts only at the start of a line (after spaces or tabs),
  outside fenced code blocks (markdown.py), so markup a model quotes in prose
  or code stays text. The start of the content and the point right after a
  call count as line starts.
- Whitespace that only separates calls from the rest (before an opening tag
  that becomes a call, and after a call) is dropped; all other text is
  content exactly as generated, and is emitted as soon as nothing of it can
  still turn out to be markup (trailing whitespace and a possible tag wait).
- A call whose header never completes (no parsable name) is content again,
  exactly as written, and scanning resumes inside it (a real call may follow).
- A call whose header was announced ends at its closing tag, at text that
  breaks its structure (which is content again), or at the end of the stream
  (flush), with the arguments received so far.
- An unknown function name (not among the tools, when tools are given) is
  still a call: the client decides what to do with it.
"""

from __future__ import annotations

import itertools
import re
import secrets
import string
from typing import Any

from router.chat.events import ContentDelta, ParsedEvent, ToolCallDelta
from router.parsers.call_body import BodyStep, CallBody, Outcome
from router.parsers.hermes import HermesCall
from router.parsers.markdown import MarkdownLines
from router.parsers.qwen3_coder import Qwen3CoderCall
from router.parsers.schema_values import parameter_schemas

CALL_FORMATS: dict[str, type[CallBody]] = {"hermes": HermesCall, "qwen3_coder": Qwen3CoderCall}

_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 24
_SPACE = frozenset(" \t\r\n")
_WORD = re.compile(r"[^ \t\r\n]+")


class ToolCallParser:
    """One assistant turn's content -> ContentDelta and ToolCall* events.

    format: a key of CALL_FORMATS. tools: the request's OpenAI function tools
    (their schemas type Qwen3-Coder values). prefill: text the router already
    put at the start of the assistant turn (say `<tool_call>\\n{"name": "` to
    force a call); the parser starts in the state it implies and never emits
    it as content. After flush() the parser is done.
    """

    def __init__(
        self,
        format: str,
        tools: list[dict[str, Any]] | None = None,
        *,
        id_prefix: str = "call_",
        prefill: str = "",
    ) -> None:
        if format not in CALL_FORMATS:
            raise ValueError(f"unknown tool call format {format!r}; known: {sorted(CALL_FORMATS)}")
        self._body_type = CALL_FORMATS[format]
        self._open_tag = self._body_type.open_tag
        self._schemas = parameter_schemas(tools)
        self._id_prefix = id_prefix
        self._ids: set[str] = set()
        self._markdown = MarkdownLines()
        self._events: list[ParsedEvent] = []
        self._calls = 0
        # Positions count characters of the whole stream, prefill included.
        self._fed = 0  # characters received
        self._pos = 0  # position of the next character to scan
        self._hidden = len(prefill)  # content before this position is the prefill
        self._held = ""  # whitespace, then maybe the start of an opening tag, undecided
        self._held_at = 0
        self._tag = 0  # how many characters at the end of _held match the opening tag
        self._after_call = False  # whitespace right after a call is its separator: dropped
        self._body: CallBody | None = None
        self._call_text = ("", 0)  # the call's held whitespace and tag, given back if it breaks
        if prefill:
            self._fed = len(prefill)
            self._scan(prefill)

    @property
    def calls(self) -> int:
        """Calls announced and ended so far (each sent ToolCallStart ... ToolCallEnd)."""
        return self._calls

    def feed(self, text: str) -> list[ParsedEvent]:
        self._fed += len(text)
        self._scan(text)
        return self._take()

    def flush(self, *, cut: bool = False) -> list[ParsedEvent]:
        """End of the stream: end an open call, give back what was held.

        cut: the token limit ended the stream. A call open then ends as
        incomplete (ToolCallEnd.complete False) with its arguments as
        generated; one whose name never came, or an opening tag begun, is
        dropped rather than shown as text."""
        if cut:
            return self._cut()
        while self._body is not None:
            leftover = self._call_over(self._body.finish())
            if leftover:
                self._scan(leftover)  # a broken call's text may hold a real call
        if self._held:
            self._content(self._held, self._held_at)
            self._held, self._tag = "", 0
        return self._take()

    def _cut(self) -> list[ParsedEvent]:
        if self._body is not None:
            self._events.extend(self._body.cut())
            self._body = None
        elif self._held and not self._tag:
            self._content(self._held, self._held_at)  # plain trailing whitespace
        self._held, self._tag = "", 0
        return self._take()

    def _scan(self, text: str) -> None:
        """Scan text, which starts at stream position self._pos."""
        i = 0
        while i < len(text):
            if self._body is not None:
                step = self._body.feed(text[i:] if i else text)
                if step.outcome is None:
                    self._events.extend(step.events)
                    self._pos = self._fed
                    return
                text, i = self._call_over(step), 0
                continue
            if not self._tag and self._markdown.mid_line:
                # Fast path: mid-line, a run of non-space characters can be
                # neither markup nor a separator.
                word = _WORD.match(text, i)
                if word is not None:
                    at = self._held_at if self._held else self._pos
                    self._content(self._held + word.group(), at)
                    self._held = ""
                    self._after_call = False
                    self._markdown.step_word()
                    self._pos += word.end() - i
                    i = word.end()
                    continue
            if self._step(text[i]):
                i += 1
                self._pos += 1

    def _step(self, c: str) -> bool:
        """Scan one character of content; False when it must be scanned again."""
        if self._tag:
            if c != self._open_tag[self._tag]:
                # Not a tag after all: the held part is text.
                self._markdown.feed(self._held[-self._tag:])
                self._content(self._held, self._held_at)
                self._held, self._tag = "", 0
                return False
            self._held += c
            self._tag += 1
            if self._tag == len(self._open_tag):
                self._open_call()
            return True
        if c in _SPACE:
            # Stepped first: the newline that ends a closing fence is already
            # outside the fence, so it may separate a call that follows.
            self._markdown.step(c)
            if not self._markdown.in_fence:
                if not self._after_call:
                    if not self._held:
                        self._held_at = self._pos
                    self._held += c
                return True
            self._content(self._held + c, self._held_at if self._held else self._pos)
            self._held = ""
            return True
        self._after_call = False
        if c == self._open_tag[0] and not self._markdown.in_fence and self._markdown.at_line_start:
            if not self._held:
                self._held_at = self._pos
            self._held += c
            self._tag = 1
            return True
        self._content(self._held + c, self._held_at if self._held else self._pos)
        self._held = ""
        self._markdown.step(c)
        return True

    def _open_call(self) -> None:
        self._call_text = (self._held, self._held_at)
        self._held, self._tag = "", 0
        self._body = self._body_type(self._calls, self._new_id(), self._schemas)

    def _call_over(self, step: BodyStep) -> str:
        """A call ended (step.outcome is set); return the text to scan as content next."""
        self._body = None
        self._events.extend(step.events)
        if step.outcome is Outcome.BROKEN:
            held, at = self._call_text
            self._content(held, at)
            self._markdown.feed(self._open_tag)
        else:
            self._calls += 1
            self._markdown.new_line()
            self._after_call = True
        self._pos = self._fed - len(step.leftover)
        return step.leftover

    def _content(self, text: str, at: int) -> None:
        if at < self._hidden:
            text = text[self._hidden - at:]
        if text:
            self._events.append(ContentDelta(text))

    def _new_id(self) -> str:
        while True:
            call_id = self._id_prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))
            if call_id not in self._ids:
                self._ids.add(call_id)
                return call_id

    def _take(self) -> list[ParsedEvent]:
        """The events so far, consecutive deltas of one kind merged (joined once: linear)."""
        events, self._events = self._events, []
        merged: list[ParsedEvent] = []
        for key, run in itertools.groupby(events, key=_merge_key):
            if key is None:
                merged.extend(run)
            elif key == _CONTENT:
                merged.append(ContentDelta("".join(e.text for e in run if isinstance(e, ContentDelta))))
            else:
                pieces = (e.arguments for e in run if isinstance(e, ToolCallDelta))
                merged.append(ToolCallDelta(key, "".join(pieces)))
        return merged


_CONTENT = -1


def _merge_key(event: ParsedEvent) -> int | None:
    """Events with the same key in a row merge: content, or one call's argument pieces."""
    if isinstance(event, ContentDelta):
        return _CONTENT
    if isinstance(event, ToolCallDelta):
        return event.index
    return None
