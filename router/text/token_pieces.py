"""What the routes need beyond the model's tokenizer: each token's bytes (the
`piece` of /tokenize's `with_pieces`, the `token` and `bytes` of every API's
log probabilities) and tokenizing with special tokens read as plain text
(`parse_special: false`).

Both are worked out once per tokenizer and kept while the tokenizer lives.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from functools import cache

import tokenizers

from router.text.grammar_vocab import detect_vocab_type
from router.text.offload import off_loop
from router.text.tokenizer import INLINE_ENCODE_CHARS, Tokenizer, encode_long

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: one printable character per byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


class TokenPieces:
    """One tokenizer's token bytes and its special-tokens-as-text twin."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        backend = tokenizer.backend
        # Added tokens (<|im_start|>, <think>) are stored as their own text.
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        # The decoder tells how stored tokens spell bytes; only a tokenizer
        # without one needs the whole vocabulary to guess from.
        tokens = [] if backend.decoder is not None else [
            tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        self._vocab_type = detect_vocab_type(backend, tokens)
        self._plain: tokenizers.Tokenizer | None = None
        self._plain_lock = asyncio.Lock()

    def token_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        token = self._tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        if self._vocab_type == "byte_level":
            table = _byte_level_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in token)
        if self._vocab_type == "byte_fallback":
            byte = _BYTE_TOKEN.fullmatch(token)
            return bytes([int(byte[1], 16)]) if byte else token.replace("▁", " ").encode()
        return token.encode()

    def piece(self, token_id: int) -> str | list[int]:
        """llama.cpp's piece: the text, or the bytes when they are not valid UTF-8
        (a token holding part of a character)."""
        data = self.token_bytes(token_id)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return list(data)

    def text(self, token_id: int) -> str:
        """The token's text alone, as log probabilities show it: its bytes read
        as UTF-8, a part of a character as U+FFFD (the exact bytes go beside it)."""
        return self.token_bytes(token_id).decode(errors="replace")

    async def encode_plain(self, text: str) -> list[int]:
        """Token ids of text with special tokens spelled out as ordinary text;
        added tokens that are not special (<think>) still match whole, as in
        llama.cpp, which parses its user-defined tokens either way."""
        if self._plain is None:
            async with self._plain_lock:
                if self._plain is None:
                    # A copy: the shared backend is read by other requests meanwhile.
                    self._plain = await asyncio.to_thread(self._plain_copy)
        if len(text) <= INLINE_ENCODE_CHARS:
            return self._plain.encode(text, add_special_tokens=False).ids
        return await off_loop(encode_long, self._plain, text)

    def _plain_copy(self) -> tokenizers.Tokenizer:
        copy = tokenizers.Tokenizer.from_str(self._tokenizer.backend.to_str())
        copy.encode_special_tokens = True
        return copy


_PIECES: weakref.WeakKeyDictionary[Tokenizer, TokenPieces] = weakref.WeakKeyDictionary()


def pieces_for(tokenizer: Tokenizer) -> TokenPieces:
    pieces = _PIECES.get(tokenizer)
    if pieces is None:
        pieces = _PIECES[tokenizer] = TokenPieces(tokenizer)
    return pieces
