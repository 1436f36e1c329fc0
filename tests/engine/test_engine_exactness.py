"""The whole engine (scheduler, KV pages, chunked prefill, sampler) against
Hugging Face transformers, and batched runs against solo runs.

The engine runs in-process here (EngineCore driven step by step); the socket
threads and the router are covered by the end-to-end tests.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import msgspec
import pytest
import torch

import protocol as p
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion

NEW_TOKENS = 20


def make_engine(model: Path, **overrides: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    # A small step budget and page size force chunked prefill across pages.
    # SmolLM2's weights are read once for every engine test that shares them.
    return in_process.make_engine_sharing_weights(model, **{**SMALL_STEPS, **overrides})


def run(core: EngineCore, events: list[p.EngineEvent],
        requests: dict[str, tuple[list[int], p.SamplingParams]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    for event in run_to_completion(core, events, requests):
        assert isinstance(event, p.StepOutputs), event
        for output in event.outputs:
            tokens[output.request_id].extend(output.token_ids)
    return tokens


def greedy(max_tokens: int = NEW_TOKENS) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy decoding with transformers' own KV cache, end tokens included
    (generate() would stop at them or, with min_new_tokens, mask them)."""
    from transformers import DynamicCache

    # transformers 5 renames past_key_values to cache; take whichever this version has.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {cache_arg: DynamicCache()}
    out = model(torch.tensor([prompt]), use_cache=True, **cache)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(new_tokens - 1):
        out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


CONVERSATIONS = {
    "short": [{"role": "user", "content": "Hi!"}],
    "pages": [{"role": "user", "content": "What is the capital of France?"}],
    "long": [
        {"role": "system", "content": "You are a careful assistant who answers in full sentences."},
        {"role": "user", "content": "Explain how a steam locomotive turns coal into motion, "
                                    "and why roundhouses were built around turntables."},
        {"role": "assistant", "content": "Burning coal boils water; the steam pushes pistons."},
        {"role": "user", "content": "And the turntable?"},
    ],
}


def prompts(model: Path) -> dict[str, list[int]]:
    """Real chat prompts, rendered and tokenized as the router does; the long
    one spans several prefill chunks and pages."""
    from router.text.model_text import ModelText

    text = ModelText.load(model)
    rendered = {name: text.encode_prompt(text.render_chat(messages))
                for name, messages in CONVERSATIONS.items()}
    assert len(rendered["long"]) > 3 * 24
    return rendered


@pytest.mark.parametrize("which", ["smollm2", "qwen3"])
def test_greedy_tokens_match_transformers_solo_and_batched(
    which: str, request: pytest.FixtureRequest
) -> None:
    model_path = request.getfixturevalue("smollm2_gguf" if which == "smollm2" else "tiny_qwen3_dir")
    reference = request.getfixturevalue(f"{which}_reference")
    core, events = make_engine(model_path)
    cases = prompts(model_path)
    expected = {name: hf_greedy(reference, prompt) for name, prompt in cases.items()}

    solo = {name: run(core, events, {name: (prompt, greedy())})[name] for name, prompt in cases.items()}
    together = run(core, events, {name: (prompt, greedy()) for name, prompt in cases.items()})
    for name in cases:
        assert solo[name] == expected[name], f"{which} {name}: solo differs from transformers"
        assert together[name] == expected[name], f"{which} {name}: batched differs from transformers"
    # The second round hit the prefix cache; the books still balance.
    core.scheduler.check_invariants()
    assert core.scheduler.kv.pool.num_cached > 0


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    cases = prompts(tiny_qwen3_dir)
    sampled = p.SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234,
                               ignore_eos=True)
    solo = run(core, events, {"a": (cases["pages"], sampled)})["a"]
    crowd = {"a": (cases["pages"], sampled), "b": (cases["short"], greedy()),
             "c": (cases["long"], p.SamplingParams(max_tokens=12, temperature=1.0, seed=7))}
    assert run(core, events, crowd)["a"] == solo
    other_seed = p.SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=99,
                                  ignore_eos=True)
    assert run(core, events, {"a": (cases["pages"], other_seed)})["a"] != solo


def test_preemption_keeps_greedy_tokens_exact(tiny_qwen3_dir: Path, qwen3_reference: torch.nn.Module) -> None:
    # 12 pages of 8 tokens cannot hold three sequences of 37 + 40 tokens at
    # once: the newest is preempted and later recomputed.
    core, events = make_engine(tiny_qwen3_dir, kv_capacity_tokens=96, output_window=0, max_context=96)
    cases = prompts(tiny_qwen3_dir)
    batch = {f"r{i}": (cases["long"][i : i + 37], greedy(40)) for i in range(3)}
    got = run(core, events, batch)
    assert core.scheduler.num_preemptions > 0
    for name, (prompt, _) in batch.items():
        assert got[name] == hf_greedy(qwen3_reference, prompt, 40), name


def test_bad_requests_get_errors_and_the_engine_goes_on(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir, max_context=64, kv_capacity_tokens=256)
    core.handle(p.Generate("long", list(range(10, 80)), greedy()))
    core.handle(p.Generate("vocab", [10, 10**7], greedy()))
    core.handle(p.Generate("empty", [], greedy()))
    core.handle(p.Generate("bias", [10, 11], msgspec.structs.replace(greedy(), logit_bias={10**7: 1.0})))
    errors = {e.request_id: e.code for e in events if isinstance(e, p.RequestError)}
    assert errors == {
        "long": p.ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        "vocab": p.ErrorCode.INVALID_REQUEST,
        "empty": p.ErrorCode.INVALID_REQUEST,
        "bias": p.ErrorCode.INVALID_REQUEST,
    }
    assert run(core, events, {"ok": ([10, 11, 12], greedy(3))})["ok"]


def test_abort_ends_a_request_within_one_step(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    core.handle(p.Generate("a", [10, 11, 12], greedy(1000)))
    core.handle(p.Generate("b", [13, 14, 15], greedy(5)))
    core.step()
    core.handle(p.Abort(["a"]))
    core.step()
    finished = {o.request_id: o.finish_reason for e in events if isinstance(e, p.StepOutputs)
                for o in e.outputs if o.finish_reason}
    assert finished == {"a": "abort"}
    assert len(core.scheduler.running) == 1
    while core.has_work:
        core.step()
    core.scheduler.check_invariants()


def test_sixty_four_lanes_decode_together(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir, max_concurrency=64, max_batched_tokens=1024,
                               kv_capacity_tokens=8192)
    gen = torch.Generator().manual_seed(1)
    batch = {f"r{i}": (torch.randint(10, 150000, (int(n),), generator=gen).tolist(), greedy(6))
             for i, n in enumerate(torch.randint(3, 40, (64,), generator=gen))}
    for request_id, (prompt, params) in batch.items():
        core.handle(p.Generate(request_id, prompt, params))
    most_running = 0
    while core.has_work:
        core.step()
        most_running = max(most_running, len(core.scheduler.running))
    assert most_running == 64
    together: dict[str, list[int]] = {}
    for event in events:
        for output in event.outputs:  # type: ignore[union-attr]
            together.setdefault(output.request_id, []).extend(output.token_ids)
    for request_id in ("r0", "r17", "r63"):
        assert run(core, events, {request_id: batch[request_id]})[request_id] == together[request_id]
