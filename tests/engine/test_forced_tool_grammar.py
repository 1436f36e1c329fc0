"""The structural tags of forced tool calls (router/chat/tool_grammar.py),
compiled by the engine's xgrammar compiler: once the permitted calls close,
only the end of the turn (or, with parallel calls, another call) may follow."""

from __future__ import annotations

from pathlib import Path

import pytest
import xgrammar as xgr

from engine.sampling.grammar_compiler import GrammarCompiler
from router.chat.tool_grammar import call_opener, forced_tool_grammar
from router.text.grammar_vocab import grammar_vocab
from router.text.model_text import ModelText


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


TOOLS = [_tool("get_weather"), _tool("get_time")]


def _call(name: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"city": "Paris"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(qwen3_tokenizer_dir: Path) -> tuple[GrammarCompiler, ModelText]:
    text = ModelText.load(qwen3_tokenizer_dir)
    return GrammarCompiler(grammar_vocab(text), vocab_size=151936), text


def _allowed(matcher: xgr.GrammarMatcher, text: ModelText) -> set[str]:
    mask = xgr.allocate_token_bitmask(1, 151936)
    matcher.fill_next_token_bitmask(mask)
    ids = [i for i in range(151936) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
    return {text.tokenizer.decode([i], skip_special_tokens=False) for i in ids}


@pytest.mark.parametrize("opened", [False, True])
def test_after_the_calls_only_another_call_or_the_end(compiler, opened: bool) -> None:  # type: ignore[no-untyped-def]
    comp, text = compiler
    opener = call_opener("hermes", None) if opened else ""
    spec = forced_tool_grammar("hermes", TOOLS, only=None, parallel=True, thinking="off", opener=opener)
    matcher = xgr.GrammarMatcher(comp.compile(spec))
    assert matcher.accept_string(_call("get_weather")[len(opener):])
    assert _allowed(matcher, text) == {"\n", "<|im_end|>"}
    assert not matcher.accept_string("Done")  # no free text after a call
    assert matcher.accept_string("\n" + _call("get_time"))
    assert _allowed(matcher, text) == {"\n", "<|im_end|>"}


def test_a_single_or_named_call_is_followed_by_the_end_alone(compiler) -> None:  # type: ignore[no-untyped-def]
    comp, text = compiler
    for only in (None, "get_time"):
        opener = call_opener("hermes", only)
        spec = forced_tool_grammar("hermes", TOOLS, only=only, parallel=False, thinking="off",
                                   opener=opener)
        matcher = xgr.GrammarMatcher(comp.compile(spec))
        assert matcher.accept_string(_call("get_time")[len(opener):])
        assert _allowed(matcher, text) == {"<|im_end|>"}
