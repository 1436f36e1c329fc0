"""Bounds on a JSON request body that its Struct types cannot state.

Nesting: msgspec, the templates (minijinja through router/text/chat_template.py)
and the grammar compiler all recurse over nested values, so a body nested
deeper than MAX_JSON_DEPTH is refused before any of them sees it.

Integers: JSON has no bound and msgspec decodes any integer as a Python int,
but every integer the server uses (token ids, counts, seeds) crosses to the
engine as a 64-bit msgpack integer. One outside [INT_MIN, INT_MAX] is refused,
naming where it was.

Both checks cost a few C-level passes over the raw bytes, and nothing more
for ordinary bodies.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any

import msgspec

MAX_JSON_DEPTH = 128
INT_MIN, INT_MAX = -(2**63), 2**64 - 1

# A JSON string: the unrolled form, which the re module runs without backtracking.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# Opening brackets as +1, closing as -1 (0xFF read as a signed byte).
_AS_STEPS = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")
# Any integer outside the bounds has at least 19 digits (2**63 has 19). A
# run of them is found by turning digits into "0" and the rest into " ": a
# regular expression would take ten times as long.
_DIGITS_ONLY = bytes.maketrans(bytes(range(256)),
                               bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256)))
_LONG_DIGITS = b"0" * 19


def nested_too_deeply(raw: bytes) -> bool:
    """Whether the JSON text nests arrays and objects deeper than MAX_JSON_DEPTH
    (brackets inside strings do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= MAX_JSON_DEPTH:
        return False
    steps = memoryview(brackets.translate(_AS_STEPS)).cast("b")
    return max(accumulate(steps)) > MAX_JSON_DEPTH


def out_of_range_int(raw: bytes, body: Any) -> tuple[str, int] | None:
    """The first integer of the decoded body outside [INT_MIN, INT_MAX], as
    (its path, e.g. "prompt[3]", its value); None when there is none."""
    if _LONG_DIGITS not in raw.translate(_DIGITS_ONLY):
        return None
    return _find_big_int(body, "")


def _find_big_int(value: Any, path: str) -> tuple[str, int] | None:
    # Recursion is safe: the body's depth was bounded first.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return (path, value) if not INT_MIN <= value <= INT_MAX else None
    if isinstance(value, msgspec.Struct):
        names = zip(value.__struct_fields__, value.__struct_encode_fields__, strict=True)
        items: Any = ((f"{path}.{wire}" if path else wire, getattr(value, name))
                      for name, wire in names)
    elif isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for item_path, item in items:
        found = _find_big_int(item, item_path)
        if found is not None:
            return found
    return None
