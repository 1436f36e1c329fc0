"""Stop strings over streamed text.

Text arrives in arbitrary pieces (one per engine step), and a stop string may
straddle several of them. The matcher emits text as early as it can while
guaranteeing that no part of a stop string is ever emitted: a tail that could
still grow into a stop is held back until it either completes one (everything
from the stop on is dropped) or stops being a candidate (it is released).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """One request's stop strings. Work per feed is O(len(text) + longest stop) per stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        # Empty strings would match everywhere; they mean "no stop".
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._prefixes = frozenset(s[:n] for s in self.stops for n in range(1, len(s)))
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
        found = self._first_completed_stop(buffer, len(self._held))
        if found is not None:
            at, stop = found
            self.matched = stop
            self._held = ""
            return buffer[:at], stop
        keep = self._candidate_tail(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], None

    def flush(self) -> str:
        """At the end without a match: the held-back text (it never became a stop)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _first_completed_stop(self, buffer: str, held: int) -> tuple[int, str] | None:
        # The stop that completes first in the stream wins (on a tie, the one
        # that starts first), so the outcome does not depend on how the text
        # was cut into pieces. Only a stop ending in the new text can be new:
        # the held part alone was checked before, so each search starts just
        # far enough back for that.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            at = buffer.find(stop, max(0, held - len(stop) + 1))
            if at >= 0:
                candidate = (at + len(stop), at, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _candidate_tail(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that begins some stop string."""
        for size in range(min(len(buffer), self._longest - 1), 0, -1):
            if buffer[-size:] in self._prefixes:
                return size
        return 0
