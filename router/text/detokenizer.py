"""Streaming detokenization: turn each step's new token ids into new text.

Decoding a token alone is wrong twice over: a byte-level BPE token can hold
half of a UTF-8 character, and a SentencePiece decoder strips the leading
space of whatever comes first. So each step decodes a short window that
starts a few tokens back (the prefix offset) and emits only what lies beyond
the text already read (the read offset), as vLLM and TGI do. The window only
moves forward at a clean point (text not ending in U+FFFD); complete
characters past the read offset are still emitted as soon as they exist.

With a byte-level tokenizer (Tokenizer.decodes_bytewise), a step of one token
whose text is whole characters, after a window that is all read and whole
characters, needs no window decode: the window's text is the prefix's text
followed by the token's, so the token's own (cached) text is what it adds.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context for the first generated ones.
PROMPT_CONTEXT_TOKENS = 5
# Valid text reaches a clean token boundary within a few tokens (at most 3 in
# a run of random astral-plane characters with SmolLM2's and Qwen3's
# vocabularies). Text still ending in U+FFFD after this many held tokens is
# invalid, not incomplete, and is let through so that the window (and the cost
# of a step) stays small.
MAX_HELD_TOKENS = 16
# Emitted pieces kept apart before they are joined into one string.
PIECES_KEPT = 256


class IncrementalDetokenizer:
    """One request's detokenizer. `add` costs O(window), independent of the text so far."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._bytewise = getattr(tokenizer, "decodes_bytewise", False)
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._ids: list[int] = context      # the window: only tokens from the prefix offset on
        self._read = len(context)           # window index where unread tokens start
        self._prefix_text: str | None = None  # decode(window[:read]), cached
        self._held_chars = 0                # chars past the read offset already emitted
        self._pieces: list[str] = []        # all text emitted so far (joined on demand)
        self.num_tokens = 0                 # generated tokens taken so far

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def add(self, token_ids: Sequence[int]) -> str:
        """Take a step's new token ids; return the text they complete (maybe "")."""
        if not token_ids:
            return ""
        if self._bytewise and len(token_ids) == 1 and self._read == len(self._ids):
            out = self._add_whole(token_ids[0])
            if out is not None:
                return out
        self._ids.extend(token_ids)
        self.num_tokens += len(token_ids)
        end = len(self._ids)
        new_text = self._unread_text(end)
        if not new_text.endswith(REPLACEMENT_CHAR) or end - self._read >= MAX_HELD_TOKENS:
            out = new_text[self._held_chars:]
            self._advance(end)
            return self._emit(out)
        out = ""
        # The step ends inside a character. If one of its inner token boundaries
        # is clean, move the window there, or a run of multi-token steps that
        # all end mid-character would keep the window growing.
        for cut in range(end - 1, max(self._read, end - len(token_ids)), -1):
            text = self._unread_text(cut)
            if not text.endswith(REPLACEMENT_CHAR):
                out = text[self._held_chars:]
                self._advance(cut)
                new_text = self._unread_text(end)
                break
        # Emit the complete characters before the unfinished one.
        stable = new_text.rstrip(REPLACEMENT_CHAR)
        if len(stable) > self._held_chars:
            out += stable[self._held_chars:]
            self._held_chars = len(stable)
        return self._emit(out)

    def _add_whole(self, token_id: int) -> str | None:
        """One token after a fully read window, when both decode to whole
        characters: then the window's text is the prefix's plus the token's
        (byte-level decoding), and the window moves on to the token, exactly
        as add() would move it. None (nothing taken) otherwise."""
        prefix = self._prefix_text
        if prefix is None:
            prefix = self._prefix_text = self._decode(self._ids)
        piece = self._decode([token_id])
        if REPLACEMENT_CHAR in piece or REPLACEMENT_CHAR in prefix:
            return None
        self._ids = [token_id]
        self._read = 1
        self._prefix_text = piece
        self._held_chars = 0
        self.num_tokens += 1
        return self._emit(piece)

    def flush(self) -> str:
        """At the end of the request: whatever was held back (an unfinished character is U+FFFD)."""
        end = len(self._ids)
        if self._read == end:
            return ""
        out = self._unread_text(end)[self._held_chars:]
        self._advance(end)
        return self._emit(out)

    def _unread_text(self, end: int) -> str:
        """Text of window[read:end], decoded with the prefix tokens as context."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[:self._read])
        return self._decode(self._ids[:end])[len(self._prefix_text):]

    def _advance(self, cut: int) -> None:
        # Tokens read..cut are now fully emitted and become the prefix context.
        del self._ids[:self._read]
        self._read = cut - self._read
        self._prefix_text = None
        self._held_chars = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _emit(self, out: str) -> str:
        # Appending to one string would copy all the text at every step.
        pieces = self._pieces
        pieces.append(out)
        if len(pieces) >= PIECES_KEPT:
            pieces[:] = ["".join(pieces)]
        return out
