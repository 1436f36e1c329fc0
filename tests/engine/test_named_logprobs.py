"""Log probabilities of named token ids (SamplingParams.logprob_token_ids) at
each sampled position, against transformers' log_softmax of its float32
logits (CPU, exact to 1e-4), in a batch mixing rows that name different
numbers of ids with rows that name none or ask for nothing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import protocol as p
from protocol.sampling import MAX_LOGPROB_TOKEN_IDS
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion
from tests.engine.test_engine_exactness import prompts
from tests.engine.test_logprobs import collect, params, reference_logprobs


def test_named_logprobs_equal_transformers_log_softmax(
        tiny_qwen3_dir: Path, qwen3_reference: torch.nn.Module) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    cases = prompts(tiny_qwen3_dir)
    vocab = core.vocab_size
    requests = {
        # Qwen3's "yes" and "no", as a rerank judge names them.
        "judge": (cases["short"], params(0, logprob_token_ids=[9693, 2152])),
        # Several ids (the last token of the vocabulary among them) beside
        # top alternatives, and a sampled row with a bias the raw values ignore.
        "many": (cases["long"], params(3, logprob_token_ids=[0, 5, vocab - 1, 77, 1000])),
        "hot": (cases["pages"], params(0, temperature=1.5, seed=5, logit_bias={77: 4.0},
                                       logprob_token_ids=[77])),
        "plain": (cases["pages"], params(0)),
        "none": (cases["short"], params(-1)),
    }
    got = collect(run_to_completion(core, events, requests))
    assert got["none"][1] == []
    assert all(entry.named_logprobs == [] for entry in got["plain"][1])
    for name in ("judge", "many", "hot"):
        tokens, entries = got[name]
        prompt, settings = requests[name]
        expected = reference_logprobs(qwen3_reference, prompt, tokens)
        assert len(entries) == len(tokens) == 8
        for position, entry in enumerate(entries):
            row = expected[position]
            named = settings.logprob_token_ids
            assert len(entry.named_logprobs) == len(named), (name, position)
            for token_id, value in zip(named, entry.named_logprobs, strict=True):
                assert math.isclose(value, float(row[token_id]), abs_tol=1e-4), (name, position)
            # The sampled token's own value is unchanged by the names beside it.
            assert math.isclose(entry.logprob, float(row[tokens[position]]), abs_tol=1e-4)


def test_naming_ids_does_not_change_the_tokens(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    prompt = prompts(tiny_qwen3_dir)["pages"]
    plain = collect(run_to_completion(core, events, {"a": (prompt, params(0))}))["a"][0]
    named = params(0, logprob_token_ids=[1, 2, 3])
    assert collect(run_to_completion(core, events, {"a": (prompt, named)}))["a"][0] == plain


@pytest.mark.parametrize(("settings", "says"), [
    (params(-1, logprob_token_ids=[1]), "needs logprobs"),
    (params(0, logprob_token_ids=list(range(MAX_LOGPROB_TOKEN_IDS + 1))), "at most"),
    (params(0, logprob_token_ids=[1, 10**6]), "outside the vocabulary"),
])
def test_bad_named_ids_are_a_request_error(tiny_qwen3_dir: Path, settings: p.SamplingParams,
                                           says: str) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    core.handle(p.Generate("bad", [10, 11], settings))
    (error,) = [e for e in events if isinstance(e, p.RequestError)]
    assert error.code == p.ErrorCode.INVALID_REQUEST and says in error.message
    assert "logprob_token_ids" in error.message


@pytest.mark.gpu
def test_named_logprobs_on_cuda_match_the_same_rows_alternatives(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """bf16 with our kernels, decode steps replayed from CUDA graphs, rows
    naming ids beside rows that ask nothing: each named id's value is the
    value the same position lists for it among its top alternatives, and
    graphs give what eager steps give."""
    from tests.engine.test_gpu_engine import _engine, _qwen3_dir, _release

    path = _qwen3_dir(tmp_path_factory.mktemp("qwen3-gpu-named"), hidden_size=256,
                      intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, initializer_range=0.1)
    prompts = {f"r{i}": list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)}
    top = params(20, max_tokens=12)
    core, events = _engine(path)
    assert core.runner.graphs is not None
    first = collect(run_to_completion(core, events, {rid: (ids, top) for rid, ids in prompts.items()}))
    named = {rid: params(20, max_tokens=12, logprob_token_ids=[*entries[0].top_ids[4::-1], 3])
             if i % 2 == 0 else params(-1, max_tokens=12)
             for i, (rid, (_, entries)) in enumerate(first.items())}
    graphs = collect(run_to_completion(core, events, {rid: (prompts[rid], named[rid])
                                                      for rid in prompts}))
    _release(core)
    core, events = _engine(path, cuda_graph=False)
    # The same first pass, so both runs find the prompts in the prefix cache:
    # in bf16 a cached prefix rounds differently from a recomputed one.
    run_to_completion(core, events, {rid: (ids, top) for rid, ids in prompts.items()})
    eager = collect(run_to_completion(core, events, {rid: (prompts[rid], named[rid])
                                                     for rid in prompts}))
    _release(core)
    assert graphs == eager
    checked = 0
    for rid, (_, entries) in graphs.items():
        if named[rid].logprobs < 0:
            assert entries == []
            continue
        assert len(entries) == 12
        for entry in entries:
            listed = dict(zip(entry.top_ids, entry.top_logprobs, strict=True))
            assert len(entry.named_logprobs) == 6
            for token_id, value in zip(named[rid].logprob_token_ids, entry.named_logprobs,
                                       strict=True):
                if token_id in listed:
                    assert value == listed[token_id]
                    checked += 1
    assert checked >= 10
