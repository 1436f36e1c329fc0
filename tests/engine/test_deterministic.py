"""Batch-invariant mode (--deterministic) on the CPU: the reference ops a
token row at a time (engine/execution/rowwise_ops.py), every step laid out
as decode rows. A request's tokens, and the logits each was drawn from, are
the same bits alone, beside other requests, under another step budget (its
prompt chunked otherwise), after a prefix-cache hit and after a multi-turn
hit whose prefix holds tokens an earlier request generated; a seeded
sampled request draws the same tokens alone and batched. Under speculation
a greedy request's tokens are plain decoding's, and sampled requests do not
draft. What the mode cannot serve is refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution.fp8_weight import Fp8Weight
from engine.execution.step_inputs import as_decode_rows, build_step_inputs
from engine.loader import load_model
from engine.process.deterministic_setup import refuse_unsupported
from tests.engine.batch_invariance import (
    Outcome,
    RecordedDrafter,
    Requests,
    prompt,
    run_recorded,
)
from tests.engine.in_process import SMALL_STEPS, make_engine, run_to_completion, step_outputs

NEW_TOKENS = 8
TARGET = prompt(1000, 29)


def greedy(max_tokens: int = NEW_TOKENS) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(model: Path, requests: Requests, **options: object) -> dict[str, Outcome]:
    core, events = make_engine(model, **{**SMALL_STEPS, "deterministic": True, **options})
    return run_recorded(core, events, requests)


def others(count: int, params: p.SamplingParams | None = None) -> Requests:
    """count requests of different lengths (5, 14, 23, ... tokens)."""
    return {f"other{i}": (prompt(2000 + 97 * i, 5 + 9 * i), params or greedy(4 + i))
            for i in range(count)}


@pytest.fixture(scope="module")
def alone(tiny_qwen3_dir: Path) -> Outcome:
    return run(tiny_qwen3_dir, {"target": (TARGET, greedy())})["target"]


@pytest.mark.parametrize("count", [1, 6])
def test_a_request_is_the_same_bits_beside_others(tiny_qwen3_dir: Path, alone: Outcome,
                                                  count: int) -> None:
    # Six others and four lanes: some wait, so the target's neighbours change
    # from step to step, and its prompt is chunked around theirs.
    batched = run(tiny_qwen3_dir, {**others(count), "target": (TARGET, greedy())})["target"]
    assert len(alone.tokens) == NEW_TOKENS and len(alone.logits) == NEW_TOKENS
    assert batched.same_bits(alone)


@pytest.mark.parametrize("budget", [5, 64])
def test_a_request_is_the_same_bits_under_any_step_budget(tiny_qwen3_dir: Path, alone: Outcome,
                                                         budget: int) -> None:
    chunked = run(tiny_qwen3_dir, {"target": (TARGET, greedy())}, max_batched_tokens=budget)
    assert chunked["target"].same_bits(alone)


def test_an_fp8_kv_cache_keeps_the_promise(tiny_qwen3_dir: Path) -> None:
    fp8 = {"kv_dtype": "fp8"}
    alone = run(tiny_qwen3_dir, {"target": (TARGET, greedy())}, **fp8)["target"]
    batched = run(tiny_qwen3_dir, {**others(2), "target": (TARGET, greedy())},
                  max_batched_tokens=13, **fp8)["target"]
    assert batched.same_bits(alone)


def test_a_prefix_hit_gives_the_same_bits(tiny_qwen3_dir: Path, alone: Outcome) -> None:
    core, events = make_engine(tiny_qwen3_dir, **SMALL_STEPS, deterministic=True)
    # A first request shares the target's first 20 tokens: two full pages of 8.
    run_recorded(core, events, {"first": (TARGET[:20] + prompt(5000, 6), greedy(3))})
    again = run_recorded(core, events, {"target": (TARGET, greedy())})["target"]
    assert again.cached_tokens >= 16
    assert again.same_bits(alone)


def test_a_multi_turn_hit_on_generated_tokens_gives_the_same_bits(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir, **SMALL_STEPS, deterministic=True)
    first = run_recorded(core, events, {"turn1": (TARGET, greedy(12))})["turn1"]
    # The next turn's prompt holds the first answer: its K/V were computed by
    # decode steps, and are reused from the cache.
    turn2 = TARGET + first.tokens + prompt(7000, 5)
    hit = run_recorded(core, events, {"turn2": (turn2, greedy())})["turn2"]
    assert hit.cached_tokens > len(TARGET)
    # Alone, in a fresh engine, the same prompt is all prefill.
    fresh = run(tiny_qwen3_dir, {"turn2": (turn2, greedy())})["turn2"]
    assert fresh.cached_tokens == 0
    assert hit.same_bits(fresh)


def test_the_mode_survives_sleep(tiny_qwen3_dir: Path, alone: Outcome) -> None:
    # Waking makes the ops again: the batch-invariant ones.
    core, events = make_engine(tiny_qwen3_dir, **SMALL_STEPS, deterministic=True)
    core.handle(p.Sleep(weights="disk"))
    core.handle(p.Wake())
    assert core.runner.model.ops.deterministic
    again = run_recorded(core, events, {**others(2), "target": (TARGET, greedy())})["target"]
    assert again.same_bits(alone)


def test_a_seeded_sampled_request_draws_the_same_tokens_beside_others(
        tiny_qwen3_dir: Path) -> None:
    seeded = p.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=1234,
                              ignore_eos=True)
    # The others sample too, some from the shared generator, one seeded.
    noisy = {**others(3, p.SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)),
             "seeded-other": (prompt(9000, 11), p.SamplingParams(max_tokens=5, temperature=0.7,
                                                                  seed=99, ignore_eos=True))}
    solo = run(tiny_qwen3_dir, {"target": (TARGET, seeded)})["target"]
    batched = run(tiny_qwen3_dir, {**noisy, "target": (TARGET, seeded)},
                  max_batched_tokens=9)["target"]
    assert len(solo.tokens) == NEW_TOKENS
    assert batched.tokens == solo.tokens
    assert batched.same_bits(solo)


def test_the_mode_computes_the_same_model(tiny_qwen3_dir: Path, alone: Outcome) -> None:
    # The row-at-a-time reference is the reference: the default engine's
    # greedy tokens, and logits within float32 rounding of its.
    core, events = make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    default = run_recorded(core, events, {"target": (TARGET, greedy())})["target"]
    assert default.tokens == alone.tokens
    for ours, theirs in zip(alone.logits, default.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_every_step_is_laid_out_as_decode_rows(tiny_qwen3_dir: Path) -> None:
    core, _ = make_engine(tiny_qwen3_dir, **{**SMALL_STEPS, "max_batched_tokens": 64},
                          deterministic=True)
    core.handle(p.Generate("a", TARGET, greedy()))
    core.handle(p.Generate("b", prompt(3000, 6), greedy()))
    out = core.scheduler.schedule()
    inputs = build_step_inputs(out, 8, every_token_a_row=True)
    counts = [chunk.num_tokens for chunk in out.chunks]
    assert sum(counts) > len(counts)  # prompt chunks in the step
    assert inputs.is_decode and inputs.max_query_len == 1
    assert inputs.seq_lens.tolist() == (inputs.positions + 1).tolist()
    # Each chunk's rows are still found (pooling and prompt scores read them).
    assert inputs.chunk_starts.tolist() == [0, counts[0], sum(counts)]
    # A step made elsewhere (the memory profile's) is laid out the same way.
    plain = build_step_inputs(out, 8)
    relaid = as_decode_rows(plain)
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        assert getattr(relaid, name).tolist() == getattr(inputs, name).tolist()


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_embeddings_pool_each_chunks_rows(tiny_qwen3_dir: Path, pooling: str) -> None:
    # Steps laid out as decode rows still pool each request's own rows: the
    # same vector as the default engine's (up to float32 rounding), and for
    # cls and last the same bytes alone as beside a generating request (mean
    # pooling adds chunk sums, which another chunking groups otherwise: the
    # mode does not promise it).
    embed = p.SamplingParams(max_tokens=0, pooling=pooling)  # type: ignore[arg-type]
    requests = {"embed": (TARGET, embed)}

    def vector(options: dict[str, object], extra: Requests) -> bytes:
        core, events = make_engine(tiny_qwen3_dir, **{**SMALL_STEPS, **options})
        (found,) = [output.embedding for output in step_outputs(
            run_to_completion(core, events, {**extra, **requests})) if output.embedding]
        return found

    alone = vector({"deterministic": True}, {})
    if pooling != "mean":
        assert vector({"deterministic": True}, others(2)) == alone
    default = vector({}, {})
    torch.testing.assert_close(torch.frombuffer(bytearray(alone), dtype=torch.float32),
                               torch.frombuffer(bytearray(default), dtype=torch.float32),
                               rtol=1e-5, atol=1e-6)


def test_prompt_scores_read_each_chunks_rows(tiny_qwen3_dir: Path) -> None:
    # Prompt log probabilities (a scored prompt runs eagerly, its rows found
    # through the chunk bounds): the same values alone and beside others,
    # and the default engine's up to float32 rounding.
    scored = p.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def scores(options: dict[str, object], extra: Requests) -> list[float]:
        core, events = make_engine(tiny_qwen3_dir, **{**SMALL_STEPS, **options})
        outputs = step_outputs(run_to_completion(core, events, {**extra, "s": (TARGET, scored)}))
        return [entry.logprob for output in outputs if output.request_id == "s"
                for entry in output.prompt_logprobs]

    alone = scores({"deterministic": True}, {})
    assert len(alone) == len(TARGET) - 1
    assert scores({"deterministic": True}, others(3)) == alone
    assert scores({}, {}) == pytest.approx(alone, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize(("options", "reason"), [
    ({"spec": "mtp"}, "--spec mtp"),
    ({"vision": True}, "--vision"),
    ({"quantize": "fp8"}, "--quantize fp8"),
    ({"gguf_weights": "packed"}, "--gguf-weights packed"),
])
def test_options_the_mode_cannot_honour_are_refused(options: dict[str, object],
                                                    reason: str) -> None:
    with pytest.raises(ValueError, match=f"--deterministic cannot be combined with {reason}"):
        p.EngineOptions(deterministic=True, **options)  # type: ignore[arg-type]
    p.EngineOptions(**options)  # type: ignore[arg-type]  # fine without the mode


@pytest.mark.parametrize(("arch", "reason"), [("qwen3_moe", "mixture-of-experts"),
                                               ("qwen3_5", "hybrid")])
def test_models_the_mode_cannot_serve_are_refused_at_load(tiny_model_factory, arch: str,
                                                          reason: str) -> None:
    with pytest.raises(ValueError, match=f"--deterministic: .* {reason}"):
        make_engine(tiny_model_factory(arch), **SMALL_STEPS, deterministic=True)


def test_fp8_matrices_are_refused(tiny_qwen3_dir: Path) -> None:
    # An FP8 checkpoint keeps such matrices on a GPU (on the CPU it loads
    # dequantized); one of them in the model is enough to refuse.
    loaded = load_model(tiny_qwen3_dir, torch.device("cpu"), torch.float32)
    refuse_unsupported(loaded, use_kernels=False)
    mlp = loaded.model.layers[0].mlp
    rows, k = mlp.down_weight.shape
    del mlp.down_weight  # a parameter slot takes no module
    mlp.down_weight = Fp8Weight([rows], k, "cpu")
    with pytest.raises(ValueError, match="FP8 or packed GGUF"):
        refuse_unsupported(loaded, use_kernels=False)


def run_drafting(model: Path, requests: Requests, recorded: dict[tuple[int, ...], list[int]]
                 ) -> tuple[dict[str, Outcome], tuple[int, int]]:
    """The requests' outcomes with the recorded drafter, and (draft tokens
    verified, kept) over all of them."""
    core, events = make_engine(model, **SMALL_STEPS, deterministic=True, spec="ngram",
                               draft_tokens=3)
    core.scheduler.drafter = RecordedDrafter(recorded)  # type: ignore[assignment]
    outcomes = run_recorded(core, events, requests)
    outputs = [output for event in events if isinstance(event, p.StepOutputs)
               for output in event.outputs]
    return outcomes, (sum(o.num_draft_tokens for o in outputs),
                      sum(o.num_draft_accepted for o in outputs))


@pytest.mark.parametrize("count", [0, 3])
def test_drafted_greedy_tokens_are_plain_decodings_alone_and_batched(tiny_qwen3_dir: Path,
                                                                    count: int) -> None:
    """Speculation under the mode: a greedy request's verified tokens are
    the argmaxes of the same logits plain decoding computes, so its tokens
    are plain decoding's, whatever shares its steps and however many of its
    drafts are kept."""
    requests = {**others(count), "target": (TARGET, greedy(12))}
    plain = run(tiny_qwen3_dir, requests)
    recorded = {tuple(requests[name][0]): outcome.tokens for name, outcome in plain.items()}
    drafted, (verified, kept) = run_drafting(tiny_qwen3_dir, requests, recorded)
    assert 0 < kept < verified
    for name in requests:
        assert drafted[name].tokens == plain[name].tokens, name


def test_sampled_rows_do_not_draft_under_the_mode(tiny_qwen3_dir: Path) -> None:
    """A seeded sampled row keeps its tokens alone and batched: it never
    drafts (its draws would depend on draft lengths, which depend on the
    batch); a greedy row beside it does."""
    sampled = p.SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    alone = run(tiny_qwen3_dir, {"target": (TARGET, sampled)})["target"]
    requests = {"greedy": (prompt(3000, 9), greedy(8)), "target": (TARGET, sampled)}
    plain = run(tiny_qwen3_dir, requests)
    recorded = {tuple(requests[name][0]): outcome.tokens for name, outcome in plain.items()}
    core, events = make_engine(tiny_qwen3_dir, **SMALL_STEPS, deterministic=True,
                               spec="ngram", draft_tokens=3)
    core.scheduler.drafter = RecordedDrafter(recorded)  # type: ignore[assignment]
    drafted = run_recorded(core, events, requests)
    assert drafted["target"].same_bits(alone)
    assert drafted["greedy"].tokens == plain["greedy"].tokens
    drafts = {output.request_id for event in events if isinstance(event, p.StepOutputs)
              for output in event.outputs if output.num_draft_tokens}
    assert drafts == {"greedy"}
