"""Log probabilities of sampled tokens against transformers' log_softmax of its
float32 logits (CPU, exact to 1e-4), for SmolLM2 (real weights) and the small
random Qwen3, in batches mixing rows that ask with rows that do not."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch

import protocol as p
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion
from tests.engine.test_engine_exactness import prompts

NEW_TOKENS = 8


def params(logprobs: int, **overrides: object) -> p.SamplingParams:
    settings: dict[str, object] = {"max_tokens": NEW_TOKENS, "temperature": 0.0,
                                   "ignore_eos": True, "logprobs": logprobs}
    settings.update(overrides)
    return p.SamplingParams(**settings)  # type: ignore[arg-type]


def collect(events: list[p.EngineEvent]) -> dict[str, tuple[list[int], list[p.TokenLogprobs]]]:
    found: dict[str, tuple[list[int], list[p.TokenLogprobs]]] = {}
    for event in events:
        assert isinstance(event, p.StepOutputs), event
        for output in event.outputs:
            tokens, logprobs = found.setdefault(output.request_id, ([], []))
            tokens.extend(output.token_ids)
            logprobs.extend(output.logprobs)
    return found


@torch.inference_mode()
def reference_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at each generated position: [len(tokens), V]."""
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:], dim=-1)


@pytest.mark.parametrize("which", ["smollm2", "qwen3"])
def test_logprobs_equal_transformers_log_softmax(which: str, request: pytest.FixtureRequest) -> None:
    model_path = request.getfixturevalue("smollm2_gguf" if which == "smollm2" else "tiny_qwen3_dir")
    reference = request.getfixturevalue(f"{which}_reference")
    core, events = in_process.make_engine_sharing_weights(model_path, **SMALL_STEPS)
    cases = prompts(model_path)
    # Three asking for 0, 5 and 20 alternatives, one not asking, one sampled
    # at a high temperature with a bias (raw log probabilities all the same).
    requests = {
        "zero": (cases["short"], params(0)),
        "five": (cases["pages"], params(5)),
        "twenty": (cases["long"], params(20)),
        "none": (cases["pages"], params(-1)),
        "hot": (cases["short"], params(3, temperature=1.5, seed=3, logit_bias={100: 5.0})),
    }
    got = collect(run_to_completion(core, events, requests))
    assert got["none"][1] == []
    for name in ("zero", "five", "twenty", "hot"):
        tokens, logprobs = got[name]
        prompt, settings = requests[name]
        assert len(tokens) == len(logprobs) == NEW_TOKENS, name
        expected = reference_logprobs(reference, prompt, tokens)
        for position, (token, entry) in enumerate(zip(tokens, logprobs, strict=True)):
            row = expected[position]
            assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-4), (name, position)
            assert len(entry.top_ids) == len(entry.top_logprobs) == settings.logprobs
            top = row.topk(settings.logprobs) if settings.logprobs else None
            if top is not None:
                assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
                # Ids match wherever their values are not tied.
                for rank, token_id in enumerate(entry.top_ids):
                    assert math.isclose(float(row[token_id]), entry.top_logprobs[rank], abs_tol=1e-4)
            if settings.temperature == 0.0:
                # Greedy: the sampled token is the most likely one.
                assert entry.logprob == pytest.approx(float(row.max()), abs=1e-4)


def test_logprobs_do_not_change_the_tokens(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    prompt = prompts(tiny_qwen3_dir)["pages"]
    sampled = params(-1, temperature=0.9, top_p=0.9, seed=11)
    plain = collect(run_to_completion(core, events, {"a": (prompt, sampled)}))["a"][0]
    with_logprobs = msgspec.structs.replace(sampled, logprobs=4)
    again = collect(run_to_completion(core, events, {"a": (prompt, with_logprobs)}))["a"][0]
    assert again == plain


def test_too_many_alternatives_is_a_request_error(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    core.handle(p.Generate("many", [10, 11], params(p.MAX_TOP_LOGPROBS + 1)))
    (error,) = [e for e in events if isinstance(e, p.RequestError)]
    assert error.code == p.ErrorCode.INVALID_REQUEST and "logprobs" in error.message


def test_scoring_a_prompt_equals_transformers_and_generates_nothing(
        tiny_qwen3_dir: Path, qwen3_reference: torch.nn.Module) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    prompt = prompts(tiny_qwen3_dir)["long"]  # several 24-token prefill chunks
    score = p.SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=3)
    outputs = [o for e in run_to_completion(core, events, {"s": (prompt, score)})
               for o in e.outputs]  # type: ignore[union-attr]
    entries = [entry for o in outputs for entry in o.prompt_logprobs]
    assert [o.token_ids for o in outputs if o.token_ids] == []
    assert outputs[-1].finish_reason == "length"
    assert len(entries) == len(prompt) - 1  # every token but the first
    with torch.inference_mode():
        logits = qwen3_reference(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], dim=-1)
    for position, entry in enumerate(entries):
        row = expected[position]
        assert math.isclose(entry.logprob, float(row[prompt[position + 1]]), abs_tol=1e-4)
        assert entry.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    # Scoring never takes the prompt from the prefix cache (it needs every
    # position's logits), though a plain request after it may.
    again = [o for e in run_to_completion(core, events, {"s2": (prompt, score)})
             for o in e.outputs]  # type: ignore[union-attr]
    assert all(o.num_cached_tokens == 0 for o in again)
    assert [e for o in again for e in o.prompt_logprobs] == entries


def test_prompt_scores_come_before_the_generated_tokens(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    prompt = prompts(tiny_qwen3_dir)["pages"]
    echo = params(0, max_tokens=4, prompt_logprobs=0)
    outputs = [o for e in run_to_completion(core, events, {"e": (prompt, echo)})
               for o in e.outputs]  # type: ignore[union-attr]
    kinds = ["prompt" if o.prompt_logprobs else "token" for o in outputs
             if o.prompt_logprobs or o.token_ids]
    assert kinds == sorted(kinds, key=lambda kind: kind != "prompt") and "token" in kinds
    assert sum(len(o.prompt_logprobs) for o in outputs) == len(prompt) - 1
    assert sum(len(o.logprobs) for o in outputs) == 4


def test_max_tokens_zero_needs_prompt_scoring(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    core.handle(p.Generate("zero", [10, 11], params(-1, max_tokens=0)))
    (error,) = [e for e in events if isinstance(e, p.RequestError)]
    assert error.code == p.ErrorCode.INVALID_REQUEST and "max_tokens" in error.message
