"""Embedding requests against transformers' own hidden states (CPU, float32):
the tiny random Qwen3's final-normed last_hidden_state, pooled (last, mean,
CLS) and normalised the same way, for prompts within one prefill chunk and
across several, alone and batched with each other and with generation."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest
import torch

import protocol as p
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion, step_outputs
from tests.engine.test_engine_exactness import prompts

POOLINGS = ("last", "mean", "cls")


def embed(pooling: str, normalize: int = 2) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=0, pooling=pooling, embd_normalize=normalize)  # type: ignore[arg-type]


def vectors(outputs: list[p.RequestOutput]) -> dict[str, list[float]]:
    """Each request's embedding (from its finishing output, the only one with it)."""
    found: dict[str, list[float]] = {}
    for output in outputs:
        if output.embedding:
            assert output.request_id not in found, "an embedding arrived twice"
            assert output.finish_reason == "length" and output.token_ids == []
            found[output.request_id] = array("f", output.embedding).tolist()
    return found


@torch.inference_mode()
def reference(model: torch.nn.Module, prompt: list[int], pooling: str,
              normalize: int = 2) -> torch.Tensor:
    """transformers' base model: last_hidden_state comes after the final norm."""
    hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].float()
    pooled = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    if normalize == -1:
        return pooled
    if normalize == 0:
        return pooled * 32760.0 / pooled.abs().max()
    return pooled / pooled.abs().pow(normalize).sum().pow(1.0 / normalize)


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    assert len(got) == expected.numel()
    torch.testing.assert_close(torch.tensor(got), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_embeddings_equal_transformers_pooled_hidden_states(
        pooling: str, tiny_qwen3_dir: Path, qwen3_reference: torch.nn.Module) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    cases = prompts(tiny_qwen3_dir)
    # The long prompt spans several 24-token prefill chunks.
    assert len(cases["long"]) > 3 * SMALL_STEPS["max_batched_tokens"]  # type: ignore[operator]
    for name, prompt in cases.items():
        got = vectors(step_outputs(run_to_completion(core, events, {name: (prompt, embed(pooling))})))
        assert_close(got[name], reference(qwen3_reference, prompt, pooling))
        assert sum(value * value for value in got[name]) == pytest.approx(1.0, abs=1e-5)
    # All of them at once, each prompt under every pooling, batched together.
    batch = {f"{name}-{kind}": (prompt, embed(kind)) for name, prompt in cases.items()
             for kind in POOLINGS}
    got = vectors(step_outputs(run_to_completion(core, events, batch)))
    for request_id, (prompt, params) in batch.items():
        assert_close(got[request_id], reference(qwen3_reference, prompt, str(params.pooling)))
    core.scheduler.check_invariants()


def test_many_short_inputs_share_steps(tiny_qwen3_dir: Path,
                                       qwen3_reference: torch.nn.Module) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **{**SMALL_STEPS, "max_concurrency": 8})
    # Different lengths, from one token to more than one chunk.
    lengths = [1, 2, 3, 5, 8, 13, 21, 30]
    inputs = {f"in{i}": ([(7 * i + 3 * j) % 5000 + 10 for j in range(n)], embed("mean"))
              for i, n in enumerate(lengths)}
    before = core._stats.forward_passes_total
    got = vectors(step_outputs(run_to_completion(core, events, inputs)))
    steps = core._stats.forward_passes_total - before
    # 83 tokens under a 24-token budget: at least 4 steps, and no more than a
    # few beyond that (one request per step would take 8 or more).
    assert steps <= 6, steps
    for request_id, (prompt, _) in inputs.items():
        assert_close(got[request_id], reference(qwen3_reference, prompt, "mean"))


@pytest.mark.parametrize("normalize", [-1, 0, 1, 3])
def test_embd_normalize_modes(normalize: int, tiny_qwen3_dir: Path,
                              qwen3_reference: torch.nn.Module) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    prompt = prompts(tiny_qwen3_dir)["pages"]
    got = vectors(step_outputs(run_to_completion(core, events, {"e": (prompt, embed("mean", normalize))})))
    expected = reference(qwen3_reference, prompt, "mean", normalize)
    scale = float(expected.abs().max())
    torch.testing.assert_close(torch.tensor(got["e"]) / scale, expected / scale,
                               atol=2e-5, rtol=1e-4)


def test_embeddings_batched_with_generation_change_no_tokens(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    cases = prompts(tiny_qwen3_dir)
    greedy = p.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def tokens(outputs: list[p.RequestOutput]) -> list[int]:
        return [t for o in outputs if o.request_id == "gen" for t in o.token_ids]

    alone = tokens(step_outputs(run_to_completion(core, events, {"gen": (cases["short"], greedy)})))
    mixed = step_outputs(run_to_completion(core, events, {
        "gen": (cases["short"], greedy), "e1": (cases["long"], embed("mean")),
        "e2": (cases["pages"], embed("last"))}))
    assert tokens(mixed) == alone and len(alone) == 12
    assert set(vectors(mixed)) == {"e1", "e2"}


def test_mean_and_cls_never_use_the_prefix_cache_but_last_may(
        tiny_qwen3_dir: Path, qwen3_reference: torch.nn.Module) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    prompt = prompts(tiny_qwen3_dir)["long"]
    # A generation fills the prefix cache with this prompt's pages.
    run_to_completion(core, events, {"warm": (prompt, p.SamplingParams(max_tokens=1))})
    for pooling in POOLINGS:
        outputs = step_outputs(run_to_completion(core, events, {pooling: (prompt, embed(pooling))}))
        (final,) = [o for o in outputs if o.finish_reason is not None]
        if pooling == "last":
            assert final.num_cached_tokens > 0
        else:
            assert final.num_cached_tokens == 0
        assert_close(vectors(outputs)[pooling], reference(qwen3_reference, prompt, pooling))


def test_an_embedding_may_fill_the_context(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **{**SMALL_STEPS, "max_context": 64})
    got = vectors(step_outputs(run_to_completion(core, events, {"full": ([11] * 64, embed("last"))})))
    assert len(got["full"]) == 64  # the tiny model's hidden size
    core.handle(p.Generate("over", [11] * 65, embed("last")))
    (error,) = [e for e in events if isinstance(e, p.RequestError)]
    assert error.code == p.ErrorCode.CONTEXT_LENGTH_EXCEEDED


@pytest.mark.parametrize(("settings", "word"), [
    ({"max_tokens": 1}, "max_tokens"),
    ({"max_tokens": 0, "prompt_logprobs": 0}, "log probabilities"),
    ({"max_tokens": 0, "embd_normalize": -2}, "embd_normalize"),
])
def test_bad_embedding_settings_are_request_errors(settings: dict[str, int], word: str,
                                                   tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    core.handle(p.Generate("bad", [10, 11], p.SamplingParams(pooling="last", **settings)))
    (error,) = [e for e in events if isinstance(e, p.RequestError)]
    assert error.code == p.ErrorCode.INVALID_REQUEST and word in error.message


def test_an_aborted_embedding_leaves_nothing_behind(tiny_qwen3_dir: Path) -> None:
    core, _ = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    prompt = prompts(tiny_qwen3_dir)["long"]
    core.handle(p.Generate("gone", prompt, embed("mean")))
    core.step()
    core.step()
    assert core.runner.pooler._partial  # a running sum between chunks
    core.handle(p.Abort(["gone"]))
    while core.has_work:
        core.step()
    assert not core.runner.pooler._partial
    core.scheduler.check_invariants()


def test_an_embedding_preempted_mid_prompt_is_recomputed_whole(
        tiny_qwen3_dir: Path, qwen3_reference: torch.nn.Module,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.scheduling.scheduler import Scheduler

    victims: list[tuple[str, int]] = []
    preempt = Scheduler._preempt

    def recorded(self: Scheduler, seq: object, out: object) -> None:
        victims.append((seq.request_id, seq.num_computed_tokens))  # type: ignore[attr-defined]
        preempt(self, seq, out)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "_preempt", recorded)
    # 14 pages of 8 tokens and no output window: two growing generations run
    # out of pages while the long prompt's running sum is half made.
    core, events = in_process.make_engine(
        tiny_qwen3_dir, **{**SMALL_STEPS, "kv_capacity_tokens": 112, "output_window": 0})
    cases = prompts(tiny_qwen3_dir)
    gen = p.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    requests = {"g1": (cases["short"], gen), "g2": (cases["pages"][:20], gen),
                "e": (cases["long"], embed("mean")), "e2": (cases["pages"], embed("cls"))}
    got = vectors(step_outputs(run_to_completion(core, events, requests)))
    assert any(request_id == "e" and 0 < computed < len(cases["long"])
               for request_id, computed in victims), (
        f"this setup no longer preempts the embedding mid-prompt ({victims}); retune it")
    assert_close(got["e"], reference(qwen3_reference, cases["long"], "mean"))
    assert_close(got["e2"], reference(qwen3_reference, cases["pages"], "cls"))
    assert not core.runner.pooler._partial
