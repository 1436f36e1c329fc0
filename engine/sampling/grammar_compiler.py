"""Compiles a request's GrammarSpec against the model's vocabulary with
xgrammar, and keeps the compiled grammars a while, since clients send the same
schema or tool set request after request.

The vocabulary comes from the router (GrammarVocab: the engine has no
tokenizer); the model's own vocabulary size decides the width of the token
masks, so ids past the tokenizer's vocabulary (padded embedding rows) are
never allowed.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from engine.sampling.grammar import GrammarCompileError
from protocol import GrammarSpec, GrammarVocab

# Compiled grammars kept, least recently used dropped first; each entry costs
# from a few KiB (a regex) to a few MiB (a large schema over a 150k vocabulary).
CACHE_ENTRIES = 64
CACHE_BYTES = 256 * 2**20
# Bounds every whitespace run in generated JSON: small models (and random
# weights) otherwise fall into endless runs of newlines and tabs, which
# any_whitespace allows. llama.cpp's JSON-schema grammars allow about as much
# (a newline and up to 20 spaces or tabs): enough for pretty-printed output.
MAX_JSON_WHITESPACE = 20

_VOCAB_TYPES = {
    "raw": xgr.VocabType.RAW,
    "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
    "byte_level": xgr.VocabType.BYTE_LEVEL,
}

# xgrammar's C++ errors start with a log prefix and a failed check's text:
# "[19:44:43] /project/cpp/regex_converter.cc:94: Check failed: (...) is false: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK_FAILED = re.compile(r"^Check failed: .*? is false: ")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's own explanation, without its C++ log decorations."""
    text = str(exc).strip() or type(exc).__name__
    text = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", text))
    return text


class GrammarCompiler:
    """One model's xgrammar compiler plus an LRU cache keyed by (kind, source)."""

    def __init__(self, vocab: GrammarVocab, *, vocab_size: int, threads: int | None = None):
        tokens = vocab.tokens
        if len(tokens) > vocab_size:
            # Tokens the model has no logits for can never be produced anyway.
            tokens = tokens[:vocab_size]
        self.tokenizer_info = xgr.TokenizerInfo(
            tokens,
            _VOCAB_TYPES[vocab.vocab_type],
            vocab_size=vocab_size,
            # The router's end-of-sequence ids, the same that stop every
            # request; None lets xgrammar guess (a model with none is rare).
            stop_token_ids=list(vocab.eos_token_ids) or None,
            add_prefix_space=vocab.add_prefix_space,
        )
        # xgrammar's own cache would grow without bound next to ours.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=threads or min(8, os.cpu_count() or 1),
            cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of spec; GrammarError when it does not compile."""
        key = (spec.kind, "" if spec.kind == "json_object" else spec.source)
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        try:
            compiled = self._compile(spec)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, its own types
            raise GrammarCompileError(
                f"the {spec.kind} grammar is invalid: {xgrammar_message(exc)}") from exc
        self._remember(key, compiled)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self._compiler
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.source, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if spec.kind == "json_object":
            # Any object, through the schema path so the whitespace bound applies
            # (the builtin JSON grammar has none); strict_mode off lets it hold
            # any properties.
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.source)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(json.dumps(_bound_json_whitespace(json.loads(spec.source))))
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def _remember(self, key: tuple[str, str], compiled: xgr.CompiledGrammar) -> None:
        self._cache[key] = compiled
        self._cache_bytes += compiled.memory_size_bytes
        while len(self._cache) > 1 and (
            len(self._cache) > CACHE_ENTRIES or self._cache_bytes > CACHE_BYTES
        ):
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= dropped.memory_size_bytes


def _bound_json_whitespace(node: Any) -> Any:
    """The structural tag with MAX_JSON_WHITESPACE in every JSON-schema
    content that sets no bound of its own, as for the json_schema kind."""
    if isinstance(node, list):
        return [_bound_json_whitespace(item) for item in node]
    if not isinstance(node, dict):
        return node
    bounded = {key: _bound_json_whitespace(value) for key, value in node.items()}
    if node.get("type") == "json_schema" and "json_schema" in node:
        # Only formats: a schema's own "type" key never sits beside "json_schema".
        bounded.setdefault("max_whitespace_cnt", MAX_JSON_WHITESPACE)
        bounded["json_schema"] = node["json_schema"]  # a schema is data, left as sent
    return bounded
