"""One model's tokenizer: a Hugging Face `tokenizers.Tokenizer` plus its BOS policy.

Two sources: a tokenizer.json (exactly what transformers loads) or the
vocabulary a GGUF file carries, rebuilt here as the equivalent `tokenizers`
pipeline. Either way the rest of the router sees one small interface.

BOS is handled here rather than by the backend's post-processor so that both
sources follow one rule: `encode(add_special_tokens=True)` prepends BOS when the
tokenizer's configuration asks for it, and nothing else is ever added.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

from router.text.offload import off_loop

log = logging.getLogger(__name__)

# llama.cpp's tokenizer.ggml.token_type values.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# tokenizer_config.json names whose tokens transformers always treats as special.
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
_GGUF_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                         "eot_token_id", "eom_token_id")

# Split patterns of the byte-level BPE families, as their tokenizer.json files spell them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> pre-tokenizer family. "digits" is llama.cpp's StarCoder
# group (SmolLM2 included): every digit on its own, then the GPT-2 regex.
_PRE_FAMILIES = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "command-r": "digits",
    "codeshell": "digits", "exaone": "digits", "minerva-7b": "digits",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "pixtral": "llama3", "dbrx": "llama3", "smaug-bpe": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "megrez": "qwen2",
}


# About 500 tokens, under a millisecond to encode (about 2.4 us a token).
INLINE_ENCODE_CHARS = 2048
# Decoding this many ids holds the GIL for about a millisecond; past it,
# decode_batch, which releases it, is worth its extra list.
INLINE_DECODE_IDS = 4096
# Texts of single ids kept per tokenizer and skip_special_tokens (a few MB at
# most); ids past this many distinct ones are decoded each time.
SINGLE_TEXTS_KEPT = 65536


class Tokenizer:
    """Encode and decode text for one model. Thread-safe: the backend is immutable once built."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 add_bos_token: bool = False, appended_eos_id: int | None = None) -> None:
        if add_bos_token and bos_token_id is None:
            raise ValueError("the tokenizer asks for a BOS token but names none")
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        # The token the tokenizer's own configuration appends to every text
        # (an embedding model's EOS, whose state last-token pooling reads:
        # Qwen3-Embedding's tokenizer.json, llama.cpp's add_eos_token), or
        # None. Only embedding inputs get it (router/embeddings.py).
        self.appended_eos_id = appended_eos_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        # One past the largest id that has a token: added tokens may leave gaps.
        self.id_limit: int = max(self.vocab_size, max(added, default=-1) + 1)
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, token in added.items() if token.special)
        # Byte-level decoding: each token stands for bytes and a text is the
        # bytes of its ids read as UTF-8, so the texts of ids that are whole
        # characters alone concatenate (decode(a + b) == decode(a) + decode(b)),
        # which the streaming detokenizer relies on (router/text/detokenizer.py).
        self.decodes_bytewise: bool = isinstance(backend.decoder, decoders.ByteLevel)
        # decode() of one id, by skip_special_tokens then id (the backend never changes).
        self._single_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. Special tokens written in the text always become their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if add_special_tokens else ids

    async def encode_async(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """encode() without blocking the event loop: long texts are encoded on
        the text pool (router/text/offload.py), which also bounds how many
        encode at once. Short ones (well under a millisecond) are encoded in
        place, where a thread hop would cost more than it saves."""
        if len(text) <= INLINE_ENCODE_CHARS:
            return self.encode(text, add_special_tokens=add_special_tokens)
        ids = await off_loop(encode_long, self.backend, text)
        return self._with_bos(ids) if add_special_tokens else ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ids; ids past the vocabulary (a model's padded embedding rows) are dropped,
        and so are ids no vocabulary has (negative, or too big for the backend's 32 bits)."""
        if len(ids) == 1:
            return self._decode_one(ids[0], skip_special_tokens)
        return self._decode_list(ids if type(ids) is list else list(ids), skip_special_tokens)

    def _decode_one(self, token_id: int, skip_special_tokens: bool) -> str:
        # The streaming detokenizer decodes each generated token alone
        # (router/text/detokenizer.py), and common tokens recur.
        cache = self._single_texts[True if skip_special_tokens else False]
        text = cache.get(token_id)
        if text is None:
            text = self._decode_list([token_id], skip_special_tokens)
            if len(cache) < SINGLE_TEXTS_KEPT:
                cache[token_id] = text
        return text

    def _decode_list(self, ids: list[int], skip_special_tokens: bool) -> str:
        if ids and (min(ids) < 0 or max(ids) >= self.id_limit):
            ids = [i for i in ids if 0 <= i < self.id_limit]
        if len(ids) > INLINE_DECODE_IDS:
            # decode_batch lets go of the GIL while it works; decode holds it.
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    @classmethod
    def from_tokenizer_json(cls, path: str | Path,
                            tokenizer_config: Mapping[str, Any] | None = None) -> Tokenizer:
        """Load tokenizer.json; tokenizer_config.json (if given) adds what transformers adds."""
        backend = tokenizers.Tokenizer.from_file(str(path))
        return cls._from_hf_backend(backend, tokenizer_config or {})

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer described by a GGUF file's `tokenizer.*` metadata."""
        model = metadata.get("tokenizer.ggml.model")
        embedded = metadata.get("tokenizer.huggingface.json")
        if isinstance(embedded, str):
            # The converter stored the original tokenizer.json: nothing to rebuild.
            backend = tokenizers.Tokenizer.from_str(embedded)
        elif model == "gpt2":
            backend = _byte_level_bpe(metadata)
        elif model == "llama":
            backend = _sentencepiece_bpe(metadata)
        else:
            raise ValueError(f"GGUF tokenizer type {model!r} is not supported "
                             "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
        _add_gguf_tokens(backend, metadata)
        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            # llama.cpp's defaults for files that predate the flag.
            pre = metadata.get("tokenizer.ggml.pre", "default")
            add_bos = model == "llama" or _PRE_FAMILIES.get(pre) == "llama3"
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        appended = (eos_id if metadata.get("tokenizer.ggml.add_eos_token") is True
                    and isinstance(eos_id, int) else _appended_special(backend))
        return cls(backend, bos_token_id=bos_id, add_bos_token=bool(add_bos) and bos_id is not None,
                   appended_eos_id=appended)

    @classmethod
    def _from_hf_backend(cls, backend: tokenizers.Tokenizer,
                         config: Mapping[str, Any]) -> Tokenizer:
        _mark_named_specials(backend, config)
        bos_token = special_token_content(config.get("bos_token"))
        bos_id = backend.token_to_id(bos_token) if bos_token else None
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"]) and bos_id is not None
        else:
            # No explicit flag (Llama 3 style): the post-processor is the
            # authority. Encoding nothing shows what it would put in front.
            added = backend.encode("", add_special_tokens=True).ids
            add_bos = len(added) > 0
            if add_bos:
                bos_id = added[0]
        return cls(backend, bos_token_id=bos_id, add_bos_token=add_bos,
                   appended_eos_id=_appended_special(backend))


def _appended_special(backend: tokenizers.Tokenizer) -> int | None:
    """The token a backend's post-processor puts after a text, if any: a text
    encoded with and without special tokens ends alike unless one is appended."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    return full[-1] if full and full[-1:] != plain[-1:] else None


def encode_long(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    """Token ids of a long text, for a text pool thread. encode() would hold
    the GIL throughout (a second per MB); the batch call lets go of it, and
    its "fast" form skips the character offsets nobody here reads."""
    return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids


def special_token_content(value: Any) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _mark_named_specials(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
    # transformers registers the tokenizer_config's named and additional special
    # tokens as special added tokens, which changes both encoding (they match
    # whole) and skip_special_tokens; do the same so ids and text agree with it.
    names = [special_token_content(config.get(key)) for key in _NAMED_SPECIALS]
    names += [special_token_content(t) for t in config.get("additional_special_tokens") or ()]
    added = backend.get_added_tokens_decoder()
    already = {token.content for token in added.values() if token.special}
    missing = [name for name in names if name and name not in already
               and backend.token_to_id(name) is not None]
    if missing:
        backend.add_special_tokens([AddedToken(name, special=True, normalized=False)
                                    for name in dict.fromkeys(missing)])


def _gguf_vocab(metadata: Mapping[str, Any]) -> tuple[list[str], dict[str, int]]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        # Keep the first id of a duplicated piece, as a lookup by text would.
        vocab.setdefault(token, token_id)
    if len(vocab) != len(tokens):
        log.warning("GGUF vocabulary repeats %d token strings; the later ids decode but never encode",
                    len(tokens) - len(vocab))
    return tokens, vocab


def _byte_level_bpe(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    _, vocab = _gguf_vocab(metadata)
    merges = [_split_merge(merge) for merge in metadata.get("tokenizer.ggml.merges") or ()]
    pre = metadata.get("tokenizer.ggml.pre", "default")
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        log.warning("unknown GGUF pre-tokenizer %r; splitting text the GPT-2 way", pre)
        family = "gpt2"
    # Llama 3's tokenizer.json sets ignore_merges: a pre-token that is itself in
    # the vocabulary is taken whole, which is not always what the merges give.
    model = tokenizers.models.BPE(vocab=vocab, merges=merges, ignore_merges=family == "llama3")
    backend = tokenizers.Tokenizer(model)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if family == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif family == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        pattern = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
        if family == "qwen2":
            backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    # Split at the first space after the first character: a piece may itself be " ".
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"malformed GGUF merge {merge!r}")
    return merge[:cut], merge[cut + 1:]


def _sentencepiece_bpe(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    arch = str(metadata.get("general.architecture", ""))
    if arch.startswith("gemma"):
        # Gemma's scores do not follow its merge order and it spells runs of
        # spaces differently; rebuilding it the generic way would mis-tokenize.
        raise ValueError(f"SentencePiece tokenizers of {arch!r} GGUF files are not supported")
    tokens, vocab = _gguf_vocab(metadata)
    types = metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges = metadata.get("tokenizer.ggml.merges")
    if merges:
        pairs = [_split_merge(merge) for merge in merges]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not scores:
            raise ValueError("a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores or merges")
        pairs = _merges_from_scores(tokens, types, scores, vocab)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], types: Sequence[int], scores: Sequence[float],
                        vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    # SentencePiece BPE stores a score per piece instead of merges: the piece
    # learned earlier scores higher. Every way to cut a normal piece into two
    # known pieces is a merge, ranked by the score of the piece it makes.
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, token_type, score in zip(tokens, types, scores, strict=True):
        if token_type != TOKEN_NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-score, left_id, right_id, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_gguf_tokens(backend: tokenizers.Tokenizer, metadata: Mapping[str, Any]) -> None:
    # CONTROL tokens (and the named BOS/EOS/...) are special; USER_DEFINED ones
    # like "<think>" are plain added tokens. Both must match whole in text, or a
    # chat template's "<|im_start|>" would be cut into pieces.
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    special_ids = {token_id for token_id, token_type in enumerate(types)
                   if token_type in (TOKEN_CONTROL, TOKEN_UNKNOWN)}
    for key in _GGUF_SPECIAL_ID_KEYS:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            special_ids.add(token_id)
    user_ids = [i for i, token_type in enumerate(types)
                if token_type == TOKEN_USER_DEFINED and i not in special_ids]
    if special_ids:
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i in sorted(special_ids)])
    if user_ids:
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i in user_ids])
