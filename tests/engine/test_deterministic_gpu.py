"""Batch-invariant mode (--deterministic) on the GPU: bf16, our kernels, CUDA
graphs. A request's tokens and the logits each was drawn from are the same
bits alone and beside 1 to 63 other requests of other lengths (decode graphs
of every padded size, eager mixed steps), with graphs off, under other step
budgets (its prompt chunked otherwise), after a prefix-cache hit and after a
multi-turn hit on tokens an earlier request generated; a seeded sampled
request draws the same tokens alone and batched (the sampling kernel).
Under speculation a greedy request's tokens are plain decoding's, alone and
batched, with drafts kept and rejected (verify steps on the decode graphs).

Models: random-weight Qwen3 (q/k norms) and Qwen2 (q/k/v biases) with 128-wide
heads, which our kernels and graphs serve.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import protocol as p
from tests.engine.batch_invariance import (
    Outcome,
    RecordedDrafter,
    Requests,
    prompt,
    run_recorded,
)
from tests.engine.in_process import make_engine
from tests.support.tiny_models import QWEN_BOS, QWEN_EOS, QWEN_VOCAB, save_with_qwen3_tokenizer

pytestmark = pytest.mark.gpu

NEW_TOKENS = 16
TARGET = prompt(1000, 150)
LANES = 64
OPTIONS: dict[str, object] = {"device": "cuda", "max_concurrency": LANES,
                              "max_batched_tokens": 512, "max_context": 4096, "page_size": 16,
                              "kv_capacity_tokens": 131072, "deterministic": True}


def _model_dir(arch: str, target: Path) -> Path:
    import transformers

    shape = dict(vocab_size=QWEN_VOCAB, hidden_size=512, intermediate_size=1536,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=8192, rope_theta=1_000_000.0, initializer_range=0.05,
                 bos_token_id=QWEN_BOS, eos_token_id=QWEN_EOS)
    config = (transformers.Qwen3Config(**shape, head_dim=128, tie_word_embeddings=True)
              if arch == "qwen3" else transformers.Qwen2Config(**shape, tie_word_embeddings=False))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    save_with_qwen3_tokenizer(model, target)
    return target


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _model_dir(request.param, tmp_path_factory.mktemp(request.param))


def greedy(max_tokens: int = NEW_TOKENS) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(model: Path, requests: Requests, **options: object) -> dict[str, Outcome]:
    merged = {**OPTIONS, **options}
    core, events = make_engine(model, **merged)
    assert core.runner.use_kernels
    assert core.runner.model.ops.deterministic == merged["deterministic"]
    outcomes = run_recorded(core, events, requests)
    del core, events
    gc.collect()
    torch.cuda.empty_cache()
    return outcomes


def others(count: int, params: p.SamplingParams | None = None) -> Requests:
    """count requests of 5 to ~400 prompt tokens and 4 to 19 new tokens."""
    return {f"other{i}": (prompt(2000 + 131 * i, 5 + (37 * i) % 400),
                          params or greedy(4 + i % 16)) for i in range(count)}


@pytest.fixture(scope="module")
def alone(model_dir: Path) -> Outcome:
    outcome = run(model_dir, {"target": (TARGET, greedy())})["target"]
    assert len(outcome.tokens) == NEW_TOKENS and len(outcome.logits) == NEW_TOKENS
    return outcome


@pytest.mark.parametrize("count", [1, 7, 31, LANES - 1])
def test_the_same_bits_beside_others(model_dir: Path, alone: Outcome, count: int) -> None:
    batched = run(model_dir, {**others(count), "target": (TARGET, greedy())})["target"]
    assert batched.same_bits(alone)


def test_the_same_bits_with_graphs_off(model_dir: Path, alone: Outcome) -> None:
    eager = run(model_dir, {**others(9), "target": (TARGET, greedy())}, cuda_graph=False)
    assert eager["target"].same_bits(alone)


@pytest.mark.parametrize("budget", [64, 2048])
def test_the_same_bits_under_another_step_budget(model_dir: Path, alone: Outcome,
                                                 budget: int) -> None:
    chunked = run(model_dir, {**others(5), "target": (TARGET, greedy())},
                  max_batched_tokens=budget)
    assert chunked["target"].same_bits(alone)


def test_the_same_bits_after_a_prefix_hit(model_dir: Path, alone: Outcome) -> None:
    core, events = make_engine(model_dir, **OPTIONS)
    run_recorded(core, events, {"first": (TARGET[:100] + prompt(5000, 20), greedy(3))})
    again = run_recorded(core, events, {**others(3), "target": (TARGET, greedy())})["target"]
    assert again.cached_tokens >= 96
    assert again.same_bits(alone)


def test_the_same_bits_after_a_multi_turn_hit(model_dir: Path) -> None:
    core, events = make_engine(model_dir, **OPTIONS)
    first = run_recorded(core, events, {**others(7), "turn1": (TARGET, greedy(40))})["turn1"]
    # The second turn's prefix holds the first answer, whose K/V decode steps
    # computed (batched with others); alone in a fresh engine it is prefilled.
    turn2 = TARGET + first.tokens + prompt(7000, 30)
    hit = run_recorded(core, events, {"turn2": (turn2, greedy())})["turn2"]
    assert hit.cached_tokens > len(TARGET)
    fresh = run(model_dir, {"turn2": (turn2, greedy())})["turn2"]
    assert fresh.cached_tokens == 0
    assert hit.same_bits(fresh)


def test_a_seeded_request_draws_the_same_tokens_beside_others(model_dir: Path) -> None:
    seeded = p.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, top_k=50,
                              seed=1234, ignore_eos=True)
    solo = run(model_dir, {"target": (TARGET, seeded)})["target"]
    sampled = p.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    batched = run(model_dir, {**others(20, sampled), "target": (TARGET, seeded)})["target"]
    assert batched.tokens == solo.tokens
    assert batched.same_bits(solo)


def test_the_mode_computes_the_same_model(model_dir: Path, alone: Outcome) -> None:
    # Up to bf16 rounding, the default path's logits of the first token.
    default = run(model_dir, {"target": (TARGET, greedy(1))}, deterministic=False)["target"]
    ours, theirs = alone.logits[0], default.logits[0]
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.999


@pytest.mark.parametrize("count", [0, 7, 31])
def test_drafted_greedy_tokens_are_plain_decodings(model_dir: Path, count: int) -> None:
    requests = {**others(count), "target": (TARGET, greedy())}
    plain = run(model_dir, requests)
    recorded = {tuple(requests[name][0]): outcome.tokens for name, outcome in plain.items()}
    core, events = make_engine(model_dir, **OPTIONS, spec="ngram", draft_tokens=4)
    core.scheduler.drafter = RecordedDrafter(recorded)  # type: ignore[assignment]
    drafted = run_recorded(core, events, requests)
    outputs = [output for event in events if isinstance(event, p.StepOutputs)
               for output in event.outputs]
    assert 0 < sum(o.num_draft_accepted for o in outputs) < sum(o.num_draft_tokens
                                                                for o in outputs)
    for name in requests:
        assert drafted[name].tokens == plain[name].tokens, name
    del core, events
    gc.collect()
    torch.cuda.empty_cache()
