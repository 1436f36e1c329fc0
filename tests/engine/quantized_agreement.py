"""How a quantized model's greedy tokens are judged against a reference
engine (issue 19's criterion): the first tokens agree, and every token is
among the reference's five most likely after the same tokens. Shared by
the packed-GGUF and FP8 GPU tests."""

from __future__ import annotations

from pathlib import Path

import protocol as p
from tests.engine.in_process import make_engine, run_to_completion, step_outputs

PROMPTS = [[1, 7, 300, 42, 9] * 4, list(range(10, 47)), [3] * 11, list(range(380, 3, -9))]
AGREED_TOKENS = 4


def _engine(model: Path, **options: object):  # type: ignore[no-untyped-def]
    return make_engine(model, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=4,
                       max_batched_tokens=256, kv_capacity_tokens=4096, **options)


def greedy_tokens(model: Path, **options: object) -> list[list[int]]:
    """16 greedy tokens after each of PROMPTS, one request at a time."""
    core, events = _engine(model, **options)
    params = p.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    found = []
    for index, prompt in enumerate(PROMPTS):
        outputs = step_outputs(run_to_completion(core, events, {f"r{index}": (prompt, params)}))
        found.append([t for o in outputs for t in o.token_ids])
    return found


def agreed(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens a and b share."""
    counts = []
    for x, y in zip(a, b, strict=True):
        same = 0
        while same < min(len(x), len(y)) and x[same] == y[same]:
            same += 1
        counts.append(same)
    return counts


def reference_top5(model: Path, produced: list[list[int]], **options: object
                   ) -> list[list[list[int]]]:
    """Per prompt, per produced token: the reference engine's five most
    likely tokens after the prompt and the produced tokens before it."""
    core, events = _engine(model, **options)
    score = p.SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=5)
    found = []
    for index, (prompt, tokens) in enumerate(zip(PROMPTS, produced, strict=True)):
        outputs = step_outputs(run_to_completion(core, events,
                                                 {f"s{index}": (prompt + tokens, score)}))
        entries = [entry for o in outputs for entry in o.prompt_logprobs]
        found.append([entry.top_ids for entry in entries[len(prompt) - 1:]])
    return found


def assert_within_top5(produced: list[list[int]], top5: list[list[list[int]]]) -> None:
    """Every produced token is among the reference's five most likely after
    the same tokens (so after a divergence at a near-tie it keeps following
    the reference's view)."""
    for prompt_index, (tokens, tops) in enumerate(zip(produced, top5, strict=True)):
        for position, (token, top) in enumerate(zip(tokens, tops, strict=True)):
            assert token in top, (prompt_index, position, token, top)
