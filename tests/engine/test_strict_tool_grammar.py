"""The grammar of strict tools under tool_choice auto (router/chat/tool_grammar.py
strict_tools_grammar), compiled by the engine's xgrammar compiler with the
Qwen3 tokenizer: text stays free, a call once opened must be one of the
tools, and a strict tool's arguments must follow its schema. Last, the
tiny random Qwen3 generates under it in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from engine.sampling.grammar_compiler import GrammarCompiler
from router.chat.events import ToolCallEnd
from router.chat.tool_grammar import strict_tools_grammar
from router.parsers import ToolCallParser
from router.text.grammar_vocab import grammar_vocab
from router.text.model_text import ModelText
from tests.engine.test_grammar import make_engine, params, prefer, run

IM_END = 151645
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
# Not strict: its arguments stay free.
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
TOOLS = [WEATHER, SEARCH]
STRICT = {"get_weather"}


def _hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _coder(name: str, parameters: dict[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.fixture(scope="module")
def compiler(qwen3_tokenizer_dir: Path) -> tuple[GrammarCompiler, ModelText]:
    text = ModelText.load(qwen3_tokenizer_dir)
    return GrammarCompiler(grammar_vocab(text), vocab_size=151936), text


def _matcher(compiler: tuple[GrammarCompiler, ModelText], tool_format: str = "hermes", *,
             parallel: bool = True, thinking: str = "off") -> xgr.GrammarMatcher:
    spec = strict_tools_grammar(tool_format, TOOLS, strict=STRICT, parallel=parallel, thinking=thinking)
    return xgr.GrammarMatcher(compiler[0].compile(spec))


def _accepts(matcher: xgr.GrammarMatcher, text: str, *, then_end: bool = True) -> bool:
    """The text is accepted and (then_end) the turn may end right after it."""
    return matcher.accept_string(text) and (not then_end or matcher.accept_token(IM_END))


def _allowed(matcher: xgr.GrammarMatcher, text: ModelText) -> set[str]:
    mask = xgr.allocate_token_bitmask(1, 151936)
    matcher.fill_next_token_bitmask(mask)
    ids = [i for i in range(151936) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
    return {text.tokenizer.decode([i], skip_special_tokens=False) for i in ids}


def test_free_text_and_no_call_at_all_are_accepted(compiler) -> None:  # type: ignore[no-untyped-def]
    assert _accepts(_matcher(compiler), "It is sunny in Paris, I think.\nAsk me more!")
    assert _matcher(compiler).accept_token(IM_END)  # an empty answer
    # The text before a call, and between parallel calls, is the model's own.
    call = _hermes("get_weather", '{"city": "Paris", "days": 3}')
    assert _accepts(_matcher(compiler), f"Let me check.\n{call}\nAnd:\n{call}\nDone.")


@pytest.mark.parametrize("arguments", [
    '{"city": "Paris"}',  # "days" is required
    '{"city": "Paris", "days": 9}',  # above the maximum
    '{"city": "Paris", "days": "3"}',  # a string, not an integer
    '{"city": "Ville-de-Paris", "days": 3}',  # longer than maxLength
    '{"city": "Paris", "days": 3, "units": "C"}',  # additionalProperties: false
    '"Paris"',  # not an object
])
def test_a_strict_call_must_follow_its_schema(compiler, arguments: str) -> None:  # type: ignore[no-untyped-def]
    assert not _accepts(_matcher(compiler), "Checking.\n" + _hermes("get_weather", arguments))
    assert _accepts(_matcher(compiler), "Checking.\n" + _hermes("get_weather", '{"city": "Paris", "days": 7}'))


def test_a_tool_without_strict_keeps_free_arguments_but_unknown_tools_are_refused(compiler) -> None:  # type: ignore[no-untyped-def]
    assert _accepts(_matcher(compiler), _hermes("search", '{"query": ["not", "its", "schema"]}'))
    assert not _accepts(_matcher(compiler), _hermes("get_time", "{}"), then_end=False)
    # However it is spelled, an opened call is a call: no strict call escapes.
    assert not _accepts(_matcher(compiler), '<tool_call>\n{"name":"get_weather"', then_end=False)
    assert not _accepts(_matcher(compiler), '<tool_call>\n{"arguments": {}', then_end=False)


def test_without_parallel_calls_only_the_end_follows_the_call(compiler) -> None:  # type: ignore[no-untyped-def]
    matcher = _matcher(compiler, parallel=False)
    assert matcher.accept_string("Sure.\n" + _hermes("get_weather", '{"city": "Rome", "days": 1}'))
    assert _allowed(matcher, compiler[1]) == {"<|im_end|>"}


def test_thinking_is_free_and_the_calls_after_it_are_held(compiler) -> None:  # type: ignore[no-untyped-def]
    bad = _hermes("get_weather", '{"city": 1}')
    good = _hermes("get_weather", '{"city": "Oslo", "days": 2}')
    # Quoted in the thinking, a broken call is only thought.
    assert _accepts(_matcher(compiler, thinking="open"), f"<think>\nMaybe {bad}?\n</think>\n\n{good}")
    assert not _accepts(_matcher(compiler, thinking="open"), f"<think>\nhm\n</think>\n\n{bad}")
    assert not _accepts(_matcher(compiler, thinking="open"), good)  # the thinking comes first
    assert _accepts(_matcher(compiler, thinking="inside"), f"hm\n</think>\n\n{good}")


def test_qwen3_coder_calls_follow_the_schema_as_parameters(compiler) -> None:  # type: ignore[no-untyped-def]
    good = _coder("get_weather", {"city": "Lima", "days": "4"})
    assert _accepts(_matcher(compiler, "qwen3_coder"), f"One moment.\n{good}")
    assert not _accepts(_matcher(compiler, "qwen3_coder"), _coder("get_weather", {"city": "Lima", "days": "x"}))
    assert not _accepts(_matcher(compiler, "qwen3_coder"), _coder("get_weather", {"town": "Lima", "days": "4"}))
    assert _accepts(_matcher(compiler, "qwen3_coder"), _coder("search", {"anything": "goes"}))


TOOL_CALL = 151657  # "<tool_call>"
NEWLINE = 198  # "\n"


def _follows_schema(arguments: str) -> bool:
    try:
        value = json.loads(arguments)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"city", "days"} and isinstance(value["city"], str)
            and len(value["city"]) <= 8 and type(value["days"]) is int and 1 <= value["days"] <= 7)


@pytest.mark.parametrize("strict", [True, False])
def test_the_tiny_model_calls_a_strict_tool_with_valid_arguments(
        tiny_qwen3_dir: Path, compiler, monkeypatch: pytest.MonkeyPatch, strict: bool) -> None:  # type: ignore[no-untyped-def]
    text = compiler[1]
    core, events = make_engine(tiny_qwen3_dir)
    core.handle(grammar_vocab(text))
    prompt = text.encode_prompt(text.render_chat(
        [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], enable_thinking=False))
    # After two tokens of free text, a new line and <tool_call> are the
    # model's favourites once, as for a model that decides to call (a call
    # counts at the start of a line); the rest is its own.
    prefer(core, monkeypatch, [NEWLINE], after=2, steps=1)
    prefer(core, monkeypatch, [TOOL_CALL], after=3, steps=1)
    spec = strict_tools_grammar("hermes", [WEATHER], strict={"get_weather"} if strict else set(),
                                parallel=False, thinking="off")
    result = run(core, events, {"r": (prompt, params(spec, max_tokens=80))})["r"]
    parser = ToolCallParser("hermes", [WEATHER])
    parsed = parser.feed(text.tokenizer.decode(result.tokens)) + parser.flush(cut=result.finish_reason == "length")
    calls = [event for event in parsed if isinstance(event, ToolCallEnd)]
    if strict:
        # The call closes, and then only the end of the turn may follow.
        assert result.finish_reason == "stop" and result.tokens[-1] == IM_END, result
        (call,) = calls
        assert call.complete and call.name == "get_weather" and _follows_schema(call.arguments), call
    else:
        # The control: the random model's arguments, left free, break the schema.
        assert not any(_follows_schema(call.arguments) for call in calls), calls
