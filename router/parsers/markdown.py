"""Just enough Markdown to tell markup a model writes from markup it quotes.

A tool call's opening tag counts only at the start of a line (after spaces
or tabs) outside fenced code blocks. Inline code spans need no tracking on
top of that: we take a span to end with its line (CommonMark lets one run on
within a paragraph, but whether a backtick opens a span is only known when a
matching one closes it, and one stray backtick would then hide every later
call), so a tag at a line's start is never inside one.
"""

from __future__ import annotations

from enum import Enum, auto


class _Phase(Enum):
    INDENT = auto()  # only spaces or tabs so far on this line
    RUN = auto()  # then a run of backticks or tildes: maybe a fence
    REST = auto()  # anything else


_MAX_FENCE_INDENT = 3  # CommonMark: four spaces make an indented code block instead


class MarkdownLines:
    """Follows text character by character: at a line's start? inside a fenced block?"""

    def __init__(self) -> None:
        self.fence: tuple[str, int] | None = None  # the open fence's character and length
        self.new_line()

    @property
    def at_line_start(self) -> bool:
        return self._phase is _Phase.INDENT

    @property
    def mid_line(self) -> bool:
        """Past the part of a line that can open a tag or a fence."""
        return self._phase is _Phase.REST

    @property
    def in_fence(self) -> bool:
        return self.fence is not None

    def new_line(self) -> None:
        """Start a line (also used right after a tool call, which counts as a line of its own)."""
        self._phase = _Phase.INDENT
        self._indent = 0
        self._run_char = ""
        self._run = 0
        self._rest_blank = True

    def feed(self, text: str) -> None:
        for c in text:
            self.step(c)

    def step_word(self) -> None:
        """Mid-line, a run of non-space characters (the same as stepping each)."""
        assert self._phase is _Phase.REST
        self._rest_blank = False

    def step(self, c: str) -> None:
        if c == "\n":
            self._end_line()
        elif self._phase is _Phase.INDENT:
            if c in " \t":
                self._indent += 1
            elif c in "`~" and self._indent <= _MAX_FENCE_INDENT:
                self._phase = _Phase.RUN
                self._run_char = c
                self._run = 1
            else:
                self._phase = _Phase.REST
                self._rest_blank = False
        elif self._phase is _Phase.RUN and c == self._run_char:
            self._run += 1
        else:
            self._phase = _Phase.REST
            self._rest_blank = self._rest_blank and c in " \t\r"

    def _end_line(self) -> None:
        if self._run >= 3:
            if self.fence is None:
                self.fence = (self._run_char, self._run)  # an info string may follow
            elif self._run_char == self.fence[0] and self._run >= self.fence[1] and self._rest_blank:
                self.fence = None
        self.new_line()
