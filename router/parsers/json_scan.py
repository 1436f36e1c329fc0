"""Incremental JSON pieces for the tool-call parsers.

Text arrives in arbitrary pieces, so each reader keeps just enough state to
resume mid-token: a string decoder that survives an escape cut in two, and a
bracket follower that finds where a nested object or array ends without
validating what is inside it (a call's arguments are streamed as written).
"""

from __future__ import annotations

import re


class Malformed(Exception):
    """The text broke the expected structure at index `at` of the piece being read.

    Never leaves the parsers: a broken call returns as content instead.
    """

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
# Runs of characters that need no decoding; strict JSON forbids raw control characters.
_PLAIN_STRICT = re.compile(r'[^"\\\x00-\x1f]+')
_PLAIN_LENIENT = re.compile(r'[^"\\]+')
_REPLACEMENT = "\ufffd"


class JsonStringDecoder:
    """Decodes the body of one JSON string (after its opening quote), piece by piece.

    strict=False accepts raw control characters (models write raw newlines in
    string-valued arguments more often than they escape them).
    """

    def __init__(self, *, strict: bool = True) -> None:
        self.done = False
        self.broken = False  # stopped at a character no JSON string may hold there
        self._plain = _PLAIN_STRICT if strict else _PLAIN_LENIENT
        self._escape = ""  # an escape cut by a piece boundary: "\\", "\\u", "\\u00", ...
        self._high: int | None = None  # a high surrogate waiting for its low half

    def feed(self, text: str, i: int) -> tuple[str, int]:
        """Decode from text[i:]; return (decoded text, index after what was consumed).

        Stops just after the closing quote (sets done), or at a bad character
        (sets broken; the index is the bad character's, and what was decoded
        before it is returned, so the result does not depend on where the
        pieces were cut).
        """
        out: list[str] = []
        n = len(text)
        while i < n:
            if self._escape:
                decoded = self._escape_char(text[i])
                if decoded is None:
                    self.broken = True
                    break
                out.append(decoded)
                i += 1
                continue
            c = text[i]
            if c == '"':
                self.done = True
                out.append(self._lone_high())
                return "".join(out), i + 1
            if c == "\\":
                self._escape = "\\"
                i += 1
                continue
            run = self._plain.match(text, i)
            if run is None:
                self.broken = True
                break
            out.append(self._lone_high() + run.group())
            i = run.end()
        return "".join(out), i

    def _escape_char(self, c: str) -> str | None:
        """Add one character to the escape in progress; return what it completes (None: invalid)."""
        if len(self._escape) == 1:
            if c == "u":
                self._escape = "\\u"
                return ""
            if c not in _ESCAPES:
                return None
            self._escape = ""
            return self._lone_high() + _ESCAPES[c]
        if c not in _HEX:
            return None
        self._escape += c
        if len(self._escape) < 6:
            return ""
        code = int(self._escape[2:], 16)
        self._escape = ""
        return self._code_point(code)

    def _code_point(self, code: int) -> str:
        # NOTE: a lone surrogate becomes U+FFFD: Python would keep it, and the
        # text could then not be encoded as UTF-8 on the way to the client.
        if 0xD800 <= code < 0xDC00:
            pending = self._lone_high()
            self._high = code
            return pending
        if 0xDC00 <= code < 0xE000:
            if self._high is None:
                return _REPLACEMENT
            high, self._high = self._high, None
            return chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00))
        return self._lone_high() + chr(code)

    def _lone_high(self) -> str:
        if self._high is None:
            return ""
        self._high = None
        return _REPLACEMENT


_OUTSIDE = re.compile(r'[{}\[\]"<]')
_INSIDE = re.compile(r'["\\]')


class BracketFollower:
    """Follows one JSON object or array by its brackets and strings to find its end.

    It does not validate: arguments are passed on as the model wrote them.
    Bracket kinds are not matched against each other, only counted.
    """

    def __init__(self) -> None:
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, i: int) -> int:
        """Consume text[i:] up to the value's end (sets done) or up to a '<' outside strings.

        Returns the index reached; a '<' is not consumed: it may open the
        closing tag of a call whose JSON never closed, which the caller decides.
        """
        n = len(text)
        while i < n:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                    i += 1
                    continue
                found = _INSIDE.search(text, i)
                if found is None:
                    return n
                i = found.end()
                if found.group() == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                continue
            found = _OUTSIDE.search(text, i)
            if found is None:
                return n
            c = found.group()
            if c == "<":
                return found.start()
            i = found.end()
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self.done = True
                    return i
        return n
