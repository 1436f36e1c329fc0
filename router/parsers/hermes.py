"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes), one JSON object per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The object is read key by key. "name" must be a string and completes the
header (ToolCallStart). The value of "arguments" (or "parameters", as some
models write) is streamed as the model writes it: an object or array
verbatim, a string unwrapped (a JSON text written as a JSON string), null
as no arguments. Other keys are skipped. Keys may come in any order:
arguments written before the name are sent right after the start.

A closing tag also ends a call whose JSON never closed (a truncated
"arguments" object is sent as it is). After the object closes, anything but
whitespace and the closing tag ends the call and is content again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from router.parsers.call_body import CallBody, State
from router.parsers.json_scan import BracketFollower, JsonStringDecoder, Malformed

_ARGUMENT_KEYS = frozenset({"arguments", "parameters"})
_SCALAR = re.compile(r"[\w.+\-]*")  # a number, true, false or null, as far as it goes


class HermesCall(CallBody):
    """One call's JSON object, read key by key as it streams."""

    def __init__(self, index: int, call_id: str, schemas: Mapping[str, dict[str, Any]]) -> None:
        super().__init__(index, call_id, schemas)
        self._key = ""
        self._has_arguments = False
        self._string = JsonStringDecoder()
        self._string_parts: list[str] = []
        self._brackets = BracketFollower()
        self._sends_value = False  # the value being read is the arguments (else it is skipped)
        self._scalar: list[str] = []
        self._state = self._open

    def _finish_arguments(self) -> None:
        # Cut inside a scalar "arguments" value: send what there is of it.
        if self._state == self._scalar_value and self._sends_value:
            self._send_scalar()

    def _finish_cut_arguments(self) -> None:
        if self._state == self._scalar_value and self._sends_value:
            self._send("".join(self._scalar))

    # The object's structure. A '<' where JSON cannot continue may open the
    # closing tag (a call cut short, or written without its last brace).

    def _open(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i < len(text):
            if text[i] != "{":
                raise Malformed(i)
            self._state = self._member
            i += 1
        return i

    def _member(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i == len(text):
            return i
        c = text[i]
        if c == '"':
            self._begin_string(self._key_string, strict=True)
            return i + 1
        if c == "}":  # also after a trailing comma, which is forgiven
            return self._object_closed(i)
        return self._close_tag_or_junk(text, i)

    def _key_string(self, text: str, i: int) -> int:
        i = self._read_string(text, i)
        if self._string.done:
            self._key = "".join(self._string_parts)
            self._state = self._colon
        return i

    def _colon(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i == len(text):
            return i
        if text[i] == ":":
            self._state = self._value
            return i + 1
        return self._close_tag_or_junk(text, i)

    def _value(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i == len(text):
            return i
        c = text[i]
        if c == "<":
            return self._close_tag_or_junk(text, i)
        if self._key == "name" and self.name is None:
            if c != '"':
                raise Malformed(i)  # a name that is not a string: no parsable header
            self._begin_string(self._name_string, strict=True)
            return i + 1
        self._sends_value = self._key in _ARGUMENT_KEYS and not self._has_arguments
        self._has_arguments |= self._sends_value
        if c in "{[":
            self._brackets = BracketFollower()
            self._state = self._nested_value
            return i
        if c == '"':
            # Lenient: raw newlines in string-valued arguments are common.
            self._begin_string(self._string_value, strict=False)
            return i + 1
        self._scalar = []
        self._state = self._scalar_value
        return i

    def _after_value(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i == len(text):
            return i
        c = text[i]
        if c == ",":
            self._state = self._member
            return i + 1
        if c == "}":
            return self._object_closed(i)
        return self._close_tag_or_junk(text, i)

    def _object_closed(self, i: int) -> int:
        if self.name is None:
            raise Malformed(i)  # the whole object without a name
        self._state = self._after_object
        return i + 1

    def _after_object(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        if i == len(text):
            return i
        return self._close_tag_or_junk(text, i)

    def _close_tag_or_junk(self, text: str, i: int) -> int:
        if text[i] != "<":
            raise Malformed(i)
        return self._expect({self.close_tag: self._closed}, text, i)

    # Values.

    def _begin_string(self, state: State, *, strict: bool) -> None:
        self._string = JsonStringDecoder(strict=strict)
        self._string_parts = []
        self._state = state

    def _read_string(self, text: str, i: int) -> int:
        decoded, i = self._string.feed(text, i)
        self._string_parts.append(decoded)
        if self._string.broken:
            raise Malformed(i)
        return i

    def _name_string(self, text: str, i: int) -> int:
        i = self._read_string(text, i)
        if self._string.done:
            name = "".join(self._string_parts).strip()
            if not name:
                raise Malformed(i - 1)
            self._start(name)
            self._state = self._after_value
        return i

    def _string_value(self, text: str, i: int) -> int:
        decoded, i = self._string.feed(text, i)
        if self._sends_value:
            self._send(decoded)
        if self._string.broken:
            raise Malformed(i)
        if self._string.done:
            self._state = self._after_value
        return i

    def _nested_value(self, text: str, i: int) -> int:
        end = self._brackets.scan(text, i)
        if self._sends_value:
            self._send(text[i:end])
        if self._brackets.done:
            self._state = self._after_value
        elif end < len(text):  # a '<' outside strings
            self._state = self._nested_tag
        return end

    def _nested_tag(self, text: str, i: int) -> int:
        # Like _in_tag, but a mismatch is not junk: what was held is argument text.
        held = self._held + text[i]
        if not self.close_tag.startswith(held):
            if self._sends_value:
                self._send(self._held)
            self._held = ""
            self._state = self._nested_value
            return i
        if held == self.close_tag:
            self._held = ""
            self._closed(text, i + 1)
        else:
            self._held = held
        return i + 1

    def _scalar_value(self, text: str, i: int) -> int:
        run = _SCALAR.match(text, i)
        assert run is not None  # the pattern matches the empty string
        self._scalar.append(run.group())
        if run.end() < len(text):
            if not "".join(self._scalar):
                raise Malformed(run.end())
            if self._sends_value:
                self._send_scalar()
            self._state = self._after_value
        return run.end()

    def _send_scalar(self) -> None:
        value = "".join(self._scalar)
        if value != "null":  # null arguments: none, sent as {}
            self._send(value)
