"""Forced tokens on CUDA (engine/sampling/forced_tokens.py): the sampling
kernel and the greedy argmax draw the forced token from a row left one finite
logit, with CUDA graphs and a row under a grammar sharing the batch; and the
same on the torch reference ops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import protocol as p
from router.chat.tool_grammar import answer_grammar
from router.text.grammar_vocab import grammar_vocab
from router.text.model_text import ModelText
from tests.engine.test_forced_tokens import END_IDS, budget, thinking_prompt
from tests.engine.test_gpu_engine import _qwen3_dir
from tests.engine.test_grammar import USER, is_user, make_engine, params, run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["kernels", "torch-ops"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 our kernels run (head size 64), or the tiny one (head
    size 16) that runs the torch reference ops on CUDA."""
    if request.param == "torch-ops":
        return request.getfixturevalue("tiny_qwen3_dir")
    return _qwen3_dir(tmp_path_factory.mktemp("qwen3-small"), hidden_size=256,
                      intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, initializer_range=0.1)


def test_budgets_on_cuda(model: Path) -> None:
    text = ModelText.load(model)
    core, events = make_engine(model, device="cuda", dtype="bfloat16")
    assert core.sampler.use_kernel == (model.name != "tiny-qwen3")
    core.handle(grammar_vocab(text))
    prompt = thinking_prompt(text, "Why is the sky blue?")
    plain = {"plain": (prompt, params(max_tokens=24, ignore_eos=True))}
    grammar = answer_grammar(p.GrammarSpec("json_schema", json.dumps(USER)), "inside")
    results = run(core, events, {
        **plain,
        "greedy": (prompt, params(max_tokens=24, ignore_eos=True, reasoning=budget(8))),
        **{f"seed{seed}": (prompt, params(max_tokens=24, ignore_eos=True, temperature=1.0,
                                          seed=seed, reasoning=budget(3 + seed)))
           for seed in (1, 2)},
        "json": (prompt, params(grammar=grammar, reasoning=budget(6, END_IDS[:2]))),
    })
    # The same prompt in the same batch: bf16 rows match up to the budget.
    alone = results["plain"].tokens
    assert results["greedy"].tokens[:8] == alone[:8] and results["greedy"].tokens[8:11] == END_IDS
    for seed in (1, 2):
        assert results[f"seed{seed}"].tokens[3 + seed:6 + seed] == END_IDS, seed
    json_tokens = results["json"].tokens
    assert json_tokens[6:8] == END_IDS[:2] and results["json"].finish_reason == "stop"
    assert is_user(json.loads(text.tokenizer.decode(json_tokens[8:], skip_special_tokens=True)))
