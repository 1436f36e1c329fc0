"""The vocabulary an engine needs for grammar-constrained decoding (GrammarVocab).

The engine compiles grammars with xgrammar but has no tokenizer, so the router
sends the tokens as its tokenizer stores them and says how to read them back
into bytes:

- "byte_level": byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2; GGUF "gpt2"),
  every byte spelled by one printable character ("Ġthe" is " the");
- "byte_fallback": SentencePiece BPE with <0xNN> byte pieces and "▁" for a
  space (Llama 2, Mistral; GGUF "llama");
- "raw": tokens are their own text.

A tokenizer rebuilt from GGUF metadata (router/text/tokenizer.py) gets the
decoder of its family (ByteLevel for "gpt2", ByteFallback for "llama"), so one
inspection of the decoder serves both sources.

Special tokens (<|im_start|>, <|endoftext|>, ...) are sent as "": the
detokenizer drops them from the text, so a grammar must never count one as
the characters of its name. xgrammar treats an empty token as special and
never allows it; end tokens are allowed by id, where the grammar may end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import tokenizers

from protocol import GrammarVocab
from router.text.model_text import ModelText

VocabType = Literal["raw", "byte_fallback", "byte_level"]

# SentencePiece's word-boundary mark.
_METASPACE = "▁"


def grammar_vocab(text: ModelText) -> GrammarVocab:
    """The GrammarVocab for a model's tokenizer: tokens[i] is token i (or ""
    for a special token or a hole in the ids)."""
    tokenizer = text.tokenizer
    tokens = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
    for token_id in tokenizer.special_token_ids:
        tokens[token_id] = ""
    vocab_type = detect_vocab_type(tokenizer.backend, tokens)
    # The same end-of-sequence ids that every request's stop_token_ids carry:
    # one derivation (ModelText), so the grammar ends where generation stops.
    return GrammarVocab(tokens, vocab_type, list(text.eos_token_ids),
                        _adds_prefix_space(tokenizer.backend, vocab_type))


def detect_vocab_type(backend: tokenizers.Tokenizer, tokens: Sequence[str]) -> VocabType:
    """How the tokens turn into bytes: from the decoder, else from the tokens."""
    names = _component_types(_state(backend.decoder))
    if "ByteLevel" in names:
        return "byte_level"
    if "ByteFallback" in names:
        return "byte_fallback"
    if names:
        # A decoder without either step (WordPiece, Metaspace alone) reads tokens as text.
        return "raw"
    return _vocab_type_from_tokens(tokens)


def _vocab_type_from_tokens(tokens: Sequence[str]) -> VocabType:
    # No decoder to ask: the vocabulary shows its own encoding, as xgrammar's
    # detection does. Byte fallback spells the 256 bytes as "<0x00>".."<0xFF>";
    # byte-level BPE has the 256 characters of its byte alphabet as tokens.
    present = set(tokens)
    if sum(f"<0x{byte:02X}>" in present for byte in range(256)) >= 128:
        return "byte_fallback"
    if sum(char in present for char in _BYTE_LEVEL_ALPHABET) >= 128:
        return "byte_level"
    return "raw"


def _adds_prefix_space(backend: tokenizers.Tokenizer, vocab_type: VocabType) -> bool:
    """Whether encoding puts a space before the text (SentencePiece's "▁" on
    the first word, ByteLevel's add_prefix_space)."""
    states = [_state(backend.pre_tokenizer), _state(backend.normalizer)]
    for component in _components(states):
        kind = component.get("type")
        if kind == "Metaspace":
            scheme = component.get("prepend_scheme")
            if scheme is None:  # tokenizers before 0.14
                return bool(component.get("add_prefix_space", False))
            return scheme in ("first", "always")
        if kind == "Prepend" and component.get("prepend") == _METASPACE:
            return True
        if kind == "ByteLevel" and vocab_type == "byte_level" and component.get("add_prefix_space"):
            return True
    return False


def _state(component: Any) -> dict[str, Any] | None:
    # A tokenizers component pickles as its tokenizer.json JSON; reading it
    # avoids serializing the whole tokenizer (its vocabulary) to find one step.
    if component is None:
        return None
    return json.loads(component.__getstate__())


def _components(states: Sequence[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Every step of the given components, Sequences flattened."""
    found: list[dict[str, Any]] = []
    pending = [state for state in states if state is not None]
    while pending:
        state = pending.pop(0)
        found.append(state)
        for key in ("decoders", "pretokenizers", "normalizers"):
            pending.extend(state.get(key) or ())
    return found


def _component_types(state: dict[str, Any] | None) -> set[str]:
    return {str(component.get("type")) for component in _components([state])}


def _byte_level_alphabet() -> frozenset[str]:
    # GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest
    # are shifted to U+0100 and up.
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [256 + n for n in range(256 - len(kept))]
    return frozenset(chr(code) for code in kept + shifted)


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
