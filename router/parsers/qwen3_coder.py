"""Qwen3-Coder tool calls, XML-like with bare-text values:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

`<function=NAME>` completes the header (ToolCallStart). The arguments are a
JSON object built as the parameters arrive: `{"city": "Paris", "days": 3}`.
A value loses one leading and one trailing newline and is typed by the
tool's schema (schema_values.py): a string parameter streams as it is
written; other types are parsed when the value ends, falling back to the
string. Without a schema (no tools, an unknown function or parameter) the
value is JSON if it parses as JSON, else a string; one that cannot start a
JSON value (a letter other than a true/false/null prefix) streams at once.

A value ends at `</parameter>`, or, since models sometimes omit it, at the
next `<parameter=`, `</function>` or `</tool_call>`. Anything else between
parameters ends the call (with its arguments closed) and is content again.
Cut inside a value, the arguments are sent as far as they got, unclosed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from enum import Enum, auto
from typing import Any

from router.parsers.call_body import CallBody, TagHandler
from router.parsers.json_scan import Malformed
from router.parsers.schema_values import typed_value, untyped_value, value_types

_FUNCTION = "<function="
_PARAMETER = "<parameter="
_END_PARAMETER = "</parameter>"
_END_FUNCTION = "</function>"
_NAME = re.compile(r"[^>\n<]*")
_VALUE_ENDS = (_END_PARAMETER, _PARAMETER, _END_FUNCTION, CallBody.close_tag)
_VALUE_END = re.compile("|".join(re.escape(end) for end in _VALUE_ENDS))
_VALUE_END_PREFIXES = frozenset(end[:n] for end in _VALUE_ENDS for n in range(1, len(end)))
_LONGEST_END = max(len(end) for end in _VALUE_ENDS)
_JSON_STARTS = frozenset('{["-0123456789')
_LITERALS = ("true", "false", "null")


class _Value(Enum):
    STRING = auto()  # streamed as a JSON string
    BUFFERED = auto()  # typed or JSON-looking: converted when it ends
    UNDECIDED = auto()  # untyped, and so far only whitespace or a true/false/null prefix


class Qwen3CoderCall(CallBody):
    """One call's <function=...> block, its parameters turned into a JSON object as they stream."""

    def __init__(self, index: int, call_id: str, schemas: Mapping[str, dict[str, Any]]) -> None:
        super().__init__(index, call_id, schemas)
        self._name_parts: list[str] = []
        self._parameters: dict[str, Any] | None = None  # the function's schema, once known
        self._has_parameters = False
        self._mode: _Value | None = None  # the value being read, if any
        self._types: tuple[str, ...] | None = None
        self._value_parts: list[str] = []
        self._value_begun = False
        self._value_held = ""  # a trailing newline and/or the start of a tag that may end the value
        self._state = self._open

    def _finish_cut_arguments(self) -> None:
        # A value still buffered for typing is sent as written, the JSON open.
        if self._mode is not None and self._mode is not _Value.STRING:
            self._send("".join(self._value_parts))

    def _finish_arguments(self) -> None:
        if self._mode is None:
            self._send("}" if self._has_parameters else "{}")
        elif self._mode is not _Value.STRING:
            # Cut inside a value: what arrived, unconverted; the JSON stays open.
            self._send("".join(self._value_parts))

    # Header.

    def _open(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i == len(text):
            return i
        return self._expect({_FUNCTION: self._function_tag}, text, i)

    def _function_tag(self, text: str, at: int) -> None:
        self._state = self._function_name

    def _function_name(self, text: str, i: int) -> int:
        run = _NAME.match(text, i)
        assert run is not None  # the pattern matches the empty string
        self._name_parts.append(run.group())
        end = run.end()
        if end == len(text):
            return end
        name = "".join(self._name_parts).strip()
        if text[end] != ">" or not name:
            raise Malformed(end)
        self._start(name)
        self._parameters = self._schemas.get(name)
        self._state = self._between
        return end + 1

    # Between parameters.

    def _between(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i == len(text):
            return i
        tags: dict[str, TagHandler] = {
            _PARAMETER: self._parameter_tag,
            _END_FUNCTION: self._function_end,
            self.close_tag: self._closed,
        }
        return self._expect(tags, text, i)

    def _parameter_tag(self, text: str, at: int) -> None:
        self._held = _PARAMETER  # given back with the name if the name is broken
        self._state = self._parameter_name

    def _parameter_name(self, text: str, i: int) -> int:
        run = _NAME.match(text, i)
        assert run is not None
        self._held += run.group()
        end = run.end()
        if end == len(text):
            return end
        name = self._held[len(_PARAMETER):].strip()
        if text[end] != ">" or not name:
            raise Malformed(end)
        self._held = ""
        self._begin_value(name)
        return end + 1

    def _function_end(self, text: str, at: int) -> None:
        self._state = self._after_function

    def _after_function(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i == len(text):
            return i
        return self._expect({self.close_tag: self._closed}, text, i)

    # A value.

    def _begin_value(self, name: str) -> None:
        opening = ", " if self._has_parameters else "{"
        self._has_parameters = True
        self._send(f"{opening}{json.dumps(name, ensure_ascii=False)}: ")
        self._types = value_types(self._parameters, name)
        self._value_parts = []
        self._value_begun = False
        self._value_held = ""
        if self._types is None:
            self._mode = _Value.UNDECIDED
        elif "string" in self._types:
            # NOTE: a string among several types wins: "3" for a string|integer
            # parameter stays "3", as the model may well have meant it.
            self._mode = _Value.STRING
            self._send('"')
        else:
            self._mode = _Value.BUFFERED
        self._state = self._value

    def _value(self, text: str, i: int) -> int:
        held = len(self._value_held)
        buffer = self._value_held + text[i:]
        found = _first_end(buffer)
        if found is None:
            keep = _held_back(buffer)
            self._value_text(buffer[:len(buffer) - keep])
            self._value_held = buffer[len(buffer) - keep:]
            return len(text)
        at, end = found
        piece = buffer[:at]
        self._value_text(piece[:-1] if piece.endswith("\n") else piece)
        self._end_value()
        after = i + at + len(end) - held  # the end completes in text: held had none
        handlers: dict[str, TagHandler] = {
            _END_PARAMETER: self._parameter_end,
            _PARAMETER: self._parameter_tag,
            _END_FUNCTION: self._function_end,
            self.close_tag: self._closed,
        }
        handlers[end](text, after)
        return after

    def _parameter_end(self, text: str, at: int) -> None:
        self._state = self._between

    def _value_text(self, text: str) -> None:
        if not text:
            return
        if not self._value_begun:
            self._value_begun = True
            text = text[1:] if text[0] == "\n" else text
            if not text:
                return
        if self._mode is _Value.STRING:
            self._send(_escape(text))
            return
        self._value_parts.append(text)
        if self._mode is _Value.UNDECIDED:
            self._decide()

    def _decide(self) -> None:
        start = "".join(self._value_parts).lstrip()
        if not start or (start[0] in "tfn" and _may_be_literal(start)):
            return
        if start[0] in _JSON_STARTS:
            self._mode = _Value.BUFFERED
            return
        self._mode = _Value.STRING
        self._send('"' + _escape("".join(self._value_parts)))
        self._value_parts = []

    def _end_value(self) -> None:
        if self._mode is _Value.STRING:
            self._send('"')
        else:
            text = "".join(self._value_parts)
            value = untyped_value(text) if self._types is None else typed_value(text, self._types)
            self._send(json.dumps(value, ensure_ascii=False))
        self._mode = None
        self._value_held = ""


def _escape(text: str) -> str:
    """text as the inside of a JSON string; escaping is per character, so pieces concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _may_be_literal(text: str) -> bool:
    """text (left-stripped) begins true/false/null, or is one followed by whitespace only."""
    return any(
        literal.startswith(text) or (text.startswith(literal) and not text[len(literal):].strip())
        for literal in _LITERALS
    )


def _first_end(buffer: str) -> tuple[int, str] | None:
    """Where the first value end in buffer starts, and which it is.

    No end contains another, so the leftmost to start is the first to complete.
    """
    found = _VALUE_END.search(buffer)
    return None if found is None else (found.start(), found.group())


def _held_back(buffer: str) -> int:
    """How much of buffer's end must wait: the start of a value end, after one newline."""
    size = 0
    for n in range(min(len(buffer), _LONGEST_END - 1), 0, -1):
        if buffer[-n:] in _VALUE_END_PREFIXES:
            size = n
            break
    if len(buffer) > size and buffer[-size - 1] == "\n":
        size += 1
    return size
