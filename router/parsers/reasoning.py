"""Reasoning ("thinking") split from the answer: <think>...</think>.

What is reasoning (the same however the text is cut into pieces):

- Reasoning opens only at the very start of the output: with an opening tag
  there, after optional whitespace (both dropped), or, with
  start_in_reasoning (the prompt ended with the opening tag), from the first
  character; an opening tag repeated at the start is then dropped too. An
  opening tag anywhere later is text.
- It closes at the first closing tag (dropped). Everything after is
  content, tags included. An output that never closes it (a length cutoff)
  is reasoning to the end.
- Without start_in_reasoning, an output that does not begin with the tag is
  all content, exactly as generated.

Whitespace trimmed, as Qwen3's "<think>\\n...\\n</think>\\n\\nanswer" needs
(so reasoning is "..." and content "answer", as in vLLM and llama.cpp):
newlines ("\\n" and "\\r", any number) right after the opening tag (or at
the start of implied reasoning), right before the closing tag, and right
after the closing tag. Spaces and tabs are kept; nothing else is trimmed.

Held back while undecided: whitespace at the start and a possible opening
tag after it; in reasoning, trailing newlines and a possible start of the
closing tag. Everything else is emitted as soon as it is fed.
"""

from __future__ import annotations

import math
from enum import Enum, auto

from router.chat.events import ContentDelta, ReasoningDelta

_NEWLINES = "\r\n"


class _Phase(Enum):
    START = auto()  # does the output open with the tag? (whitespace and a tag prefix so far)
    REASONING = auto()
    AFTER_CLOSE = auto()  # dropping the newlines after the closing tag
    CONTENT = auto()


class ReasoningParser:
    """One output's text -> ReasoningDelta and ContentDelta, plus a count of reasoning tokens.

    feed(text, tokens) takes one engine step's text and the number of tokens
    it came from. A step's tokens count as reasoning tokens when most of its
    characters belong to reasoning; the opening and closing tags do, the
    newlines after the closing tag do not. An empty step counts where the
    stream stands. Steps fed while the start is undecided are counted once it
    is decided.
    """

    def __init__(
        self,
        *,
        start_in_reasoning: bool = False,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
    ) -> None:
        if not open_tag or not close_tag:
            raise ValueError("reasoning tags must not be empty")
        self.start_in_reasoning = start_in_reasoning
        self._open = open_tag
        self._close = close_tag
        self._close_prefixes = tuple(close_tag[:n] for n in range(len(close_tag) - 1, 0, -1))
        self._phase = _Phase.START
        self._held = ""  # a suffix of the stream, undecided
        self._leading = True  # in reasoning, nothing kept yet: newlines are dropped
        self._fed = 0
        self._reasoning_end: int | None = None  # stream position where reasoning ends, once known
        self._steps: list[tuple[int, int, int]] = []  # (start, end, tokens) not yet counted
        self._reasoning_tokens = 0
        self._reasoning_chars = 0

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside reasoning.

        While the start is undecided this says what the output would be if it
        ended there: start_in_reasoning.
        """
        if self._phase is _Phase.START:
            return self.start_in_reasoning
        return self._phase is _Phase.REASONING

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the steps counted as reasoning so far (complete after flush)."""
        return self._reasoning_tokens

    @property
    def reasoning_chars(self) -> int:
        """Characters sent as ReasoningDelta so far."""
        return self._reasoning_chars

    def feed(self, text: str, tokens: int = 0) -> list[ReasoningDelta | ContentDelta]:
        if self._phase is _Phase.CONTENT:
            # Reasoning is over for good: all text is content (nothing is held
            # here), and no step from here on can count as reasoning.
            self._fed += len(text)
            return [ContentDelta(text)] if text else []
        self._steps.append((self._fed, self._fed + len(text), tokens))
        self._fed += len(text)
        out: list[ReasoningDelta | ContentDelta] = []
        buffer, self._held = self._held + text, ""
        self._split(buffer, out)
        self._count_steps()
        return out

    def flush(self) -> list[ReasoningDelta | ContentDelta]:
        """End of the output: what was held is text of the phase it is in."""
        out: list[ReasoningDelta | ContentDelta] = []
        held, self._held = self._held, ""
        if self._phase is _Phase.START:
            self._decide_start(held, found_tag=False)
            if self._phase is _Phase.REASONING and self._leading:
                held = held.lstrip(_NEWLINES)
            self._emit(held, out)
        elif self._phase is _Phase.REASONING:
            # Cut short: trailing newlines and a partial closing tag are what the model wrote.
            self._emit(held, out)
        self._count_steps()
        return out

    def _split(self, buffer: str, out: list[ReasoningDelta | ContentDelta]) -> None:
        # buffer is always a suffix of the stream: it ends at position self._fed.
        while buffer:
            if self._phase is _Phase.START:
                rest = buffer.lstrip()
                if rest.startswith(self._open):
                    self._decide_start(buffer, found_tag=True)
                    buffer = rest[len(self._open):]
                    continue
                if self._open.startswith(rest):  # whitespace and maybe part of the tag so far
                    self._held = buffer
                    return
                self._decide_start(buffer, found_tag=False)
            elif self._phase is _Phase.REASONING:
                if self._leading:
                    buffer = buffer.lstrip(_NEWLINES)
                    if not buffer:
                        return
                    self._leading = False
                at = buffer.find(self._close)
                if at >= 0:
                    self._emit(buffer[:at].rstrip(_NEWLINES), out)
                    buffer = buffer[at + len(self._close):]
                    self._phase = _Phase.AFTER_CLOSE
                    self._reasoning_end = self._fed - len(buffer)
                    continue
                keep = self._held_back(buffer)
                self._emit(buffer[:len(buffer) - keep], out)
                self._held = buffer[len(buffer) - keep:]
                return
            elif self._phase is _Phase.AFTER_CLOSE:
                buffer = buffer.lstrip(_NEWLINES)
                if buffer:
                    self._phase = _Phase.CONTENT
            else:
                self._emit(buffer, out)
                return

    def _decide_start(self, buffer: str, *, found_tag: bool) -> None:
        if found_tag or self.start_in_reasoning:
            self._phase = _Phase.REASONING
        else:
            self._phase = _Phase.CONTENT
            self._reasoning_end = self._fed - len(buffer)  # nothing before it: position 0

    def _held_back(self, buffer: str) -> int:
        """How much of reasoning's end must wait: the start of the closing tag, after newlines."""
        size = 0
        for prefix in self._close_prefixes:
            if buffer.endswith(prefix):
                size = len(prefix)
                break
        while size < len(buffer) and buffer[-size - 1] in _NEWLINES:
            size += 1
        return size

    def _emit(self, text: str, out: list[ReasoningDelta | ContentDelta]) -> None:
        if not text:
            return
        if self._phase is _Phase.REASONING:
            self._reasoning_chars += len(text)
            out.append(ReasoningDelta(text))
        else:
            out.append(ContentDelta(text))

    def _count_steps(self) -> None:
        if self._phase is _Phase.START:
            return
        end = math.inf if self._reasoning_end is None else self._reasoning_end
        for start, stop, tokens in self._steps:
            reasoning = max(0.0, min(stop, end) - start)
            if (stop > start and 2 * reasoning >= stop - start) or (stop == start and start < end):
                self._reasoning_tokens += tokens
        self._steps.clear()
