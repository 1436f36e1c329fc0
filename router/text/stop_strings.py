"""Stop strings over streamed text.

Text arrives in arbitrary pieces (one per engine step), and a stop string may
straddle several of them. The matcher emits text as early as it can while
guaranteeing that no part of a stop string is ever emitted: a tail that could
still grow into a stop is held back until it either completes one (everything
from the stop on is dropped) or stops being a candidate (it is released).

Each stop keeps a Knuth-Morris-Pratt state (how much of it the stream's end
already spells), so a feed costs time linear in the new text plus the held
tail, and memory linear in the stops: one client-chosen long stop must not
cost the router quadratic time or memory. The APIs bound the stops a request
may bring (check_stops).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from router.errors import invalid

# Per request, on every route that takes stop strings (docs/serving.md, "Limits").
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000


def check_stops(stops: Sequence[str], param: str) -> tuple[str, ...]:
    """The request's non-empty stop strings; a 400 naming param past the bounds."""
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'{param}' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}",
                      param)
    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise invalid(f"each string in '{param}' may be at most {MAX_STOP_CHARS} characters, "
                          f"got one of {len(stop)}", param)
    return tuple(s for s in stops if s)


def _prefix_function(stop: str) -> array[int]:
    """fail[i]: the length of the longest proper prefix of stop[:i + 1] that also ends it."""
    fail = array("i", bytes(4 * len(stop)))
    k = 0
    for i in range(1, len(stop)):
        char = stop[i]
        while k and stop[k] != char:
            k = fail[k - 1]
        if stop[k] == char:
            k += 1
        fail[i] = k
    return fail


class StopStringMatcher:
    """One request's stop strings. A feed costs O(len(text) + held tail) per stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        # Empty strings would match everywhere; they mean "no stop".
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._fail = [_prefix_function(s) for s in self.stops]
        # Per stop: how many of its first characters the stream currently ends with.
        self._state = [0] * len(self.stops)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        """Take new text; return (text safe to emit now, the stop string matched or None).

        After a match the matcher is finished: later feeds return ("", None).
        """
        if self.matched is not None:
            return "", None
        if not self.stops:
            return text, None
        buffer = self._held + text
        found = self._first_completed_stop(buffer)
        if found is not None:
            at, stop = found
            self.matched = stop
            self._held = ""
            return buffer[:at], stop
        for index, stop in enumerate(self.stops):
            self._state[index] = _advance(stop, self._fail[index], self._state[index], text)
        # The longest tail that still begins some stop is held back; it is a
        # suffix of the buffer, as no state grows by more than the new text.
        keep = max(self._state)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], None

    def flush(self) -> str:
        """At the end without a match: the held-back text (it never became a stop)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _first_completed_stop(self, buffer: str) -> tuple[int, str] | None:
        # The stop that completes first in the stream wins (on a tie, the one
        # that starts first), so the outcome does not depend on how the text
        # was cut into pieces. Only a stop ending in the new text can be new,
        # and it starts within the tail its state says the stream ends with.
        held = len(self._held)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop, state in zip(self.stops, self._state, strict=True):
            at = buffer.find(stop, held - state)
            if at >= 0:
                candidate = (at + len(stop), at, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])


def _advance(stop: str, fail: array[int], state: int, text: str) -> int:
    """The KMP state after text, given that no occurrence of stop completes in it."""
    if len(stop) == 1:
        return 0
    first, i, end = stop[0], 0, len(text)
    while i < end:
        if state == 0:
            # Nothing begun: jump (in C) to where the stop's first character occurs.
            i = text.find(first, i)
            if i < 0:
                return 0
            state, i = 1, i + 1
            continue
        char = text[i]
        while state and stop[state] != char:
            state = fail[state - 1]
        if stop[state] == char:
            state += 1
        i += 1
    return state
