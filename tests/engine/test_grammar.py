"""Grammar-constrained decoding and prompt-progress reports, in-process.

The model is the tiny random-weight Qwen3 with the real Qwen3 tokenizer: its
unconstrained output is garbage, so output that parses and validates shows
the grammar at work. The vocabulary reaches the engine as the router builds
it (router/text/grammar_vocab.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import protocol as p
from engine.sampling.grammar import EngineGrammar
from engine.sampling.token_mask import apply_on_host
from engine.scheduling.core import EngineCore
from engine.scheduling.sequence import Sequence
from router.text.grammar_vocab import detect_vocab_type, grammar_vocab
from router.text.model_text import ModelText
from router.text.tokenizer import Tokenizer
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion

TOKENIZER_VOCAB = 151669  # Qwen3's tokenizer; the model has 151,936 rows
IM_END = 151645
TOOL_CALL = 151657  # "<tool_call>", an ordinary (non-special) added token

USER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}


def is_user(value: Any) -> bool:
    """USER's constraints, checked by hand."""
    if not isinstance(value, dict) or not {"name", "age", "admin"} <= value.keys() <= USER["properties"].keys():
        return False
    tags = value.get("tags", [])
    return (isinstance(value["name"], str) and len(value["name"]) <= 12
            and type(value["age"]) is int and 0 <= value["age"] <= 150
            and isinstance(value["admin"], bool)
            and isinstance(tags, list) and len(tags) <= 3 and set(tags) <= {"a", "b", "c"})


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: p.RequestError | None = None
    # (num_computed_tokens, tokens received before the report) per progress report
    progress: list[tuple[int, int]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


def make_engine(model: Path, **overrides: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    # Small chunks and pages: prompts span several prefill steps.
    return in_process.make_engine(model, **{**SMALL_STEPS, **overrides})


def run(core: EngineCore, events: list[p.EngineEvent],
        requests: dict[str, tuple[list[int], p.SamplingParams]]) -> dict[str, Result]:
    results = {request_id: Result() for request_id in requests}
    for event in run_to_completion(core, events, requests):
        if isinstance(event, p.RequestError):
            results[event.request_id].error = event
            continue
        assert isinstance(event, p.StepOutputs), event
        for output in event.outputs:
            result = results[output.request_id]
            result.num_prompt_tokens = output.num_prompt_tokens
            result.num_cached_tokens = output.num_cached_tokens
            if not output.token_ids and output.finish_reason is None:
                result.progress.append((output.num_computed_tokens, len(result.tokens)))
            result.tokens.extend(output.token_ids)
            result.finish_reason = output.finish_reason or result.finish_reason
    assert len(core.grammar) == 0, "every finished request drops its matcher"
    return results


def params(grammar: p.GrammarSpec | None = None, **overrides: Any) -> p.SamplingParams:
    settings: dict[str, Any] = {"max_tokens": 160, "temperature": 0.0}
    settings.update(overrides)
    return p.SamplingParams(grammar=grammar, **settings)


@pytest.fixture(scope="module")
def text(tiny_qwen3_dir: Path) -> ModelText:
    return ModelText.load(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def vocab(text: ModelText) -> p.GrammarVocab:
    return grammar_vocab(text)


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path, vocab: p.GrammarVocab) -> tuple[EngineCore, list[p.EngineEvent]]:
    core, events = make_engine(tiny_qwen3_dir)
    core.handle(vocab)
    return core, events


@pytest.fixture(scope="module")
def prompt(text: ModelText) -> list[int]:
    return text.encode_prompt(text.render_chat([{"role": "user", "content": "A user, as JSON."}]))


def prefer(core: EngineCore, monkeypatch: pytest.MonkeyPatch, token_ids: list[int], *,
           after: int, steps: int | None = None) -> None:
    """Make token_ids the model's favourites, in that order, from its
    `after`-th sampling step on (for `steps` steps, or for good), as a model
    that wants to say them; the grammar still decides what may be said."""
    compute_logits = core.runner.model.compute_logits
    calls: list[int] = []
    bias = torch.tensor([1e4 * (len(token_ids) - rank) for rank in range(len(token_ids))])

    def biased(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        if len(calls) >= after and (steps is None or len(calls) < after + steps):
            logits[:, token_ids] += bias.to(logits.device)
        calls.append(len(calls))
        return logits

    monkeypatch.setattr(core.runner.model, "compute_logits", biased)


def decode(text: ModelText, result: Result) -> str:
    """The text a client sees: the end token is not part of it."""
    return text.tokenizer.decode(result.tokens)


# ---- the vocabulary the router sends ------------------------------------------


def test_grammar_vocab_of_a_byte_level_tokenizer(vocab: p.GrammarVocab, text: ModelText) -> None:
    assert vocab.vocab_type == "byte_level" and not vocab.add_prefix_space
    assert len(vocab.tokens) == TOKENIZER_VOCAB
    assert vocab.tokens[text.tokenizer.token_to_id("Ġthe")] == "Ġthe"
    # Special tokens are blanked (the detokenizer drops them); added ordinary ones stay.
    assert vocab.tokens[IM_END] == "" and vocab.tokens[151644] == ""
    assert vocab.tokens[TOOL_CALL] == "<tool_call>"


def test_grammar_vocab_of_gguf_tokenizers(smollm2_gguf: Path) -> None:
    assert grammar_vocab(ModelText.load(smollm2_gguf)).vocab_type == "byte_level"  # GGUF "gpt2"
    # A SentencePiece vocabulary with byte pieces, as GGUF "llama" files carry.
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "▁a", "ab", "▁ab"]
    metadata = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 6,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tokenizer = Tokenizer.from_gguf(metadata)
    assert detect_vocab_type(tokenizer.backend, tokens) == "byte_fallback"
    text = ModelText(path=Path("x.gguf"), tokenizer=tokenizer, template=None,  # type: ignore[arg-type]
                     template_origin="", eos_token_ids=(2,), bos_token_id=1, context_length=None,
                     special_tokens={})
    vocab = grammar_vocab(text)
    assert vocab.vocab_type == "byte_fallback" and vocab.add_prefix_space
    assert vocab.tokens[1] == vocab.tokens[2] == "" and vocab.tokens[259] == "▁"


def test_masks_never_allow_padded_rows_or_special_tokens(vocab: p.GrammarVocab) -> None:
    grammar = EngineGrammar(151936, torch.device("cpu"))
    grammar.set_vocab(vocab)
    free_text = {"type": "structural_tag", "format": {"type": "any_text"}}
    grammar.admit("r", p.GrammarSpec("structural_tag", json.dumps(free_text)))
    mask = grammar.fill([Sequence("r", [1, 2], params())])
    assert mask is not None and mask.rows == [0]
    logits = torch.zeros((1, 151936))
    mask.apply(logits)
    allowed = set((logits[0] == 0).nonzero().flatten().tolist())
    assert max(allowed - {IM_END}) < TOKENIZER_VOCAB  # the model's padded rows stay out
    assert 151644 not in allowed and 151643 not in allowed  # <|im_start|>, <|endoftext|>
    assert {TOOL_CALL, IM_END} <= allowed and len(allowed) > 150_000


def test_rows_filled_together_match_each_filled_alone(vocab: p.GrammarVocab) -> None:
    # Several grammar rows are filled by xgrammar's threads side by side.
    grammar = EngineGrammar(151936, torch.device("cpu"))
    grammar.set_vocab(vocab)
    grammar.admit("json", p.GrammarSpec("json_schema", json.dumps(USER)))
    grammar.admit("digits", p.GrammarSpec("regex", "[0-9]+"))
    seqs = [Sequence(rid, [1, 2], params()) for rid in ("json", "free", "digits")]
    together = grammar.fill(seqs)
    assert together is not None and together.rows == [0, 2]
    bits = together.bitmask.clone()
    for row in (0, 2):
        alone = grammar.fill([seqs[row]])
        assert alone is not None
        assert torch.equal(bits[row], alone.bitmask[0])
    assert not torch.equal(bits[0], bits[2])


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_host_masking_matches_xgrammar_kernel(rows: list[int]) -> None:
    import xgrammar

    generator = torch.Generator().manual_seed(0)
    vocab = 40_010  # not a multiple of 32: the last word is partly padding
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32, generator=generator)
    # Rows 0, 1 and 3 forbid many tokens (table biases), row 2 few (xgrammar's kernel).
    bitmask[1] = 0
    bitmask[1, 5] = 1 << 7  # token 167 alone
    bitmask[2] = -1
    bitmask[2, 7] = 0x0F0F0F0F
    bitmask[3, :1000] = 0
    bitmask[3, -1] = -1  # the last 26 tokens and 6 padding bits
    logits = torch.randn((4, vocab), generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=rows)
    apply_on_host(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    if 1 in rows:
        assert (logits[1] > float("-inf")).nonzero().flatten().tolist() == [167]


def test_compiled_grammars_are_cached_by_kind_and_source(vocab, monkeypatch) -> None:
    from engine.sampling import grammar_compiler

    monkeypatch.setattr(grammar_compiler, "CACHE_ENTRIES", 2)
    compiler = grammar_compiler.GrammarCompiler(vocab, vocab_size=151936)
    digits, letters = p.GrammarSpec("regex", "[0-9]+"), p.GrammarSpec("regex", "[a-z]+")
    first = compiler.compile(digits)
    assert compiler.compile(p.GrammarSpec("regex", "[0-9]+")) is first
    # json_object ignores its source, so any source shares one entry.
    assert compiler.compile(p.GrammarSpec("json_object", "a")) is compiler.compile(p.GrammarSpec("json_object"))
    compiler.compile(letters)  # the third entry: the least recently used one goes
    assert compiler.compile(digits) is not first


# ---- constrained generation ------------------------------------------------------


def test_json_schema_greedy_and_sampled_outputs_validate(engine, text, prompt) -> None:
    core, events = engine
    spec = p.GrammarSpec("json_schema", json.dumps(USER))
    requests = {"greedy": (prompt, params(spec)),
                **{f"seed{seed}": (prompt, params(spec, temperature=1.0, seed=seed)) for seed in (1, 2)}}
    for request_id, result in run(core, events, requests).items():
        assert result.error is None
        assert result.finish_reason == "stop", (request_id, decode(text, result))
        assert result.tokens[-1] == IM_END  # the grammar's end token is the stop
        value = json.loads(decode(text, result))
        assert is_user(value), (request_id, value)


def test_json_object_parses_as_an_object(engine, text, prompt, monkeypatch) -> None:
    core, events = engine
    # Random weights write strings that never end: after a few free steps the
    # model favours a quote, then a closing brace, wherever the grammar allows them.
    closers = [text.tokenizer.token_to_id(token) for token in ('"', '"}', "}")]
    prefer(core, monkeypatch, closers, after=6)
    spec = p.GrammarSpec("json_object", "ignored")
    requests = {"greedy": (prompt, params(spec)),
                **{f"seed{seed}": (prompt, params(spec, temperature=1.0, seed=seed)) for seed in (1, 2)}}
    for result in run(core, events, requests).values():
        assert result.finish_reason == "stop", decode(text, result)
        value = json.loads(decode(text, result))
        assert isinstance(value, dict), value


def test_regex_matches_in_full_and_stops_even_with_ignore_eos(engine, text, prompt) -> None:
    core, events = engine
    pattern = r"(yes|no), because [a-z ]{3,20}\."
    spec = p.GrammarSpec("regex", pattern)
    results = run(core, events, {"greedy": (prompt, params(spec)),
                                 "sampled": (prompt, params(spec, temperature=1.0, seed=7)),
                                 "ignore_eos": (prompt, params(spec, ignore_eos=True))})
    for result in results.values():
        assert result.finish_reason == "stop"
        assert re.fullmatch(pattern, decode(text, result)), decode(text, result)
    assert results["ignore_eos"].tokens == results["greedy"].tokens


def test_masks_do_not_leak_into_other_requests_of_the_batch(engine, text, prompt) -> None:
    core, events = engine
    # top_k keeps the seeded draws off float-rounding ties: the random model's
    # distribution over 151k tokens is so flat that a batch of another shape
    # (other GEMM kernels) could tip a draw over the whole vocabulary.
    plain = {"plain-greedy": (prompt, params(max_tokens=20, ignore_eos=True)),
             "plain-seeded": (prompt, params(max_tokens=20, ignore_eos=True, temperature=1.0,
                                             top_k=8, seed=3))}
    alone = run(core, events, plain)
    mixed = run(core, events, {
        **plain,
        "json": (prompt, params(p.GrammarSpec("json_schema", json.dumps(USER)))),
        "regex": (prompt, params(p.GrammarSpec("regex", r"[0-9]{4}"), temperature=1.0, seed=5)),
    })
    for request_id in plain:
        assert mixed[request_id].tokens == alone[request_id].tokens
    assert is_user(json.loads(decode(text, mixed["json"])))
    assert re.fullmatch(r"[0-9]{4}", decode(text, mixed["regex"]))


def test_structural_tag_free_text_then_a_tool_call_of_its_schema(engine, text, prompt,
                                                                   monkeypatch) -> None:
    core, events = engine
    free = run(core, events, {"free": (prompt, params(max_tokens=3, ignore_eos=True))})["free"]
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"],
        "tags": [{"begin": "<tool_call>", "content": {"type": "json_schema", "json_schema": weather},
                  "end": "</tool_call>"}],
        "stop_after_first": True}}
    # The random model would write free text forever: after three tokens of
    # it, <tool_call> becomes its favourite once, as for a model calling a tool.
    prefer(core, monkeypatch, [TOOL_CALL], after=3, steps=1)
    spec = p.GrammarSpec("structural_tag", json.dumps(tag))
    result = run(core, events, {"tool": (prompt, params(spec))})["tool"]
    assert result.finish_reason == "stop" and result.tokens[-1] == IM_END
    assert result.tokens[:3] == free.tokens  # free text is the model's own
    assert result.tokens[3] == TOOL_CALL
    body = text.tokenizer.decode(result.tokens[4:])
    assert body.endswith("</tool_call>"), body
    call = json.loads(body.removesuffix("</tool_call>"))
    assert set(call) == {"city", "days"} and 1 <= call["days"] <= 7 and len(call["city"]) <= 10


# ---- request errors ---------------------------------------------------------------


@pytest.mark.parametrize(("kind", "source", "says"), [
    ("json_schema", "{not json", "Failed to parse JSON"),
    ("regex", "(abc", "parenthesis is not closed"),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
    ("structural_tag", "{}", "format"),
])
def test_a_grammar_that_does_not_compile_is_a_request_error(engine, text, prompt,
                                                            kind, source, says) -> None:
    core, events = engine
    results = run(core, events, {"bad": (prompt, params(p.GrammarSpec(kind, source))),  # type: ignore[arg-type]
                                 "good": (prompt, params(p.GrammarSpec("regex", "ok")))})
    error = results["bad"].error
    assert error is not None and error.code == p.ErrorCode.INVALID_GRAMMAR
    assert says in error.message and "/project/cpp" not in error.message, error.message
    assert not results["bad"].tokens
    assert results["good"].finish_reason == "stop" and decode(text, results["good"]) == "ok"


def test_a_grammar_before_the_vocabulary_is_a_request_error(tiny_qwen3_dir, vocab, prompt) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    spec = p.GrammarSpec("regex", "[a-z]+")
    error = run(core, events, {"early": (prompt, params(spec))})["early"].error
    assert error is not None and error.code == p.ErrorCode.INVALID_REQUEST
    assert "GrammarVocab" in error.message
    assert run(core, events, {"plain": (prompt, params(max_tokens=2))})["plain"].finish_reason
    core.handle(vocab)
    assert run(core, events, {"late": (prompt, params(spec, max_tokens=4))})["late"].error is None


def test_a_grammar_the_vocabulary_cannot_finish_fails_its_request_only(tiny_qwen3_dir, prompt) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    # A raw vocabulary that can spell "a" and nothing else: after "a" the
    # grammar needs a "c" that no token gives.
    tokens = [""] * TOKENIZER_VOCAB
    tokens[64] = "a"
    core.handle(p.GrammarVocab(tokens, "raw", [IM_END]))
    results = run(core, events, {"stuck": (prompt, params(p.GrammarSpec("ebnf", 'root ::= "a" "c"'))),
                                 "plain": (prompt, params(max_tokens=5, ignore_eos=True))})
    stuck = results["stuck"]
    assert stuck.tokens == [64]
    assert stuck.error is not None and stuck.error.code == p.ErrorCode.INVALID_REQUEST
    assert "allows no token" in stuck.error.message
    assert results["plain"].finish_reason == "length" and len(results["plain"].tokens) == 5
    assert not core.has_work


# ---- prompt progress --------------------------------------------------------------


def test_progress_reports_each_prefill_chunk_before_the_first_token(engine, text) -> None:
    core, events = engine
    question = "How does a steam locomotive turn coal into motion? Why the turntables? " * 4
    long_prompt = text.encode_prompt(text.render_chat([{"role": "user", "content": question}]))
    count = len(long_prompt)
    assert count > 3 * 24
    first = run(core, events, {"first": (long_prompt, params(max_tokens=3, report_progress=True)),
                               "quiet": (long_prompt[:30], params(max_tokens=3))})
    reports = first["first"].progress
    computed = [done for done, _ in reports]
    assert computed == sorted(set(computed)) and computed[-1] == count
    assert all(received == 0 for _, received in reports)  # all before the first token
    assert len(reports) >= count // 24  # one per chunk
    assert not first["quiet"].progress
    assert first["first"].tokens and first["first"].finish_reason == "length"

    # Again: the prefix cache serves all but the last page, which counts as processed.
    again = run(core, events, {"again": (long_prompt, params(max_tokens=3, report_progress=True))})["again"]
    assert again.num_cached_tokens > 0
    assert [done for done, _ in again.progress] == [count]
    assert again.tokens == first["first"].tokens


# ---- helpers' own checks ------------------------------------------------------------


@pytest.mark.parametrize(("value", "ok"), [
    ({"name": "x", "age": 3, "admin": True}, True),
    ({"name": "x", "age": 3, "admin": True, "tags": ["a", "c"]}, True),
    ({"name": "x", "age": 3}, False),
    ({"name": "x", "age": 3.5, "admin": True}, False),
    ({"name": "x", "age": 3, "admin": True, "other": 1}, False),
])
def test_is_user_follows_the_schema(value: dict[str, Any], ok: bool) -> None:
    assert is_user(value) is ok
