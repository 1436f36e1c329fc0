"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against Hugging Face transformers.

Tiny random-weight checkpoints written by transformers' save_pretrained: the
prompt logits through our paged cache, and the greedy tokens of the whole
engine (continuous batching, chunked prefill under a 24-token step budget)
with several chat prompts batched together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.loader import load_model
from engine.models import ModelConfig
from engine.models.decoder import MLP
from engine.models.moe import SparseMoE
from tests.engine.test_engine_exactness import greedy, hf_greedy, make_engine, prompts, run
from tests.engine.test_model_exactness import LONG_TEXT, PagedRunner

MOE_ARCHITECTURES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def moe_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("tiny_model_factory")(request.param)


@pytest.fixture(scope="module")
def moe_reference(moe_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _long_prompt(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(LONG_TEXT)["input_ids"][:150]


def test_prompt_logits_match_transformers(moe_dir: Path, moe_reference: torch.nn.Module) -> None:
    prompt = _long_prompt(moe_dir)
    with torch.inference_mode():
        reference = moe_reference(torch.tensor([prompt])).logits[0].float()
    ours = load_model(moe_dir, torch.device("cpu"), torch.float32).model
    whole = PagedRunner(ours).logits([(0, prompt)])
    # In chunks of 9 tokens over 16-token pages: routing sees other row counts.
    chunked_runner = PagedRunner(ours, seed=3)
    chunked = torch.cat([chunked_runner.logits([(0, prompt[i:i + 9])])
                         for i in range(0, len(prompt), 9)])
    for name, got in (("one step", whole), ("chunked", chunked)):
        diff = (got - reference).abs().max().item()
        assert diff < 1e-4, f"{moe_dir.name} {name}: max |logit diff| {diff:.2e}"


def test_engine_greedy_tokens_match_transformers_batched(
    moe_dir: Path, moe_reference: torch.nn.Module
) -> None:
    core, events = make_engine(moe_dir)
    cases = prompts(moe_dir)
    expected = {name: hf_greedy(moe_reference, prompt) for name, prompt in cases.items()}
    together = run(core, events, {name: (prompt, greedy()) for name, prompt in cases.items()})
    for name, tokens in together.items():
        pairs = zip(tokens, expected[name], strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        assert tokens == expected[name], (
            f"{moe_dir.name} {name}: first difference at token {first}\n"
            f"ours: {tokens}\nhf:   {expected[name]}")
    core.scheduler.check_invariants()


def test_sparse_layers_follow_step_and_mlp_only_layers(tiny_model_factory) -> None:
    """The tiny Qwen3-MoE: decoder_sparse_step 2 and mlp_only_layers [3] leave
    layers 1 and 5 sparse; experts are stacked per layer."""
    loaded = load_model(tiny_model_factory("qwen3_moe"), torch.device("cpu"), torch.float32)
    kinds = [type(layer.mlp) for layer in loaded.model.layers]
    assert kinds == [MLP, SparseMoE, MLP, MLP, MLP, SparseMoE]
    moe = loaded.model.layers[1].mlp
    assert tuple(moe.gate_up_weight.shape) == (8, 64, 64)
    assert tuple(moe.down_weight.shape) == (8, 64, 32)
    assert tuple(moe.router_weight.shape) == (8, 64)


def _qwen3_moe_config(**overrides: object) -> dict:
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True,
    }
    return {**cfg, **overrides}


def test_qwen3_moe_config_reads_released_and_transformers5_keys() -> None:
    released = ModelConfig.from_hf_config(_qwen3_moe_config())
    assert released.moe is not None
    assert released.moe.sparse_layers == (0, 1, 2, 3)
    assert (released.moe.num_experts, released.moe.experts_per_token) == (8, 2)
    cfg = _qwen3_moe_config(decoder_sparse_step=2, mlp_only_layers=[1])
    del cfg["num_experts"]
    cfg["num_local_experts"] = 8  # what transformers 5's save_pretrained writes
    stepped = ModelConfig.from_hf_config(cfg)
    assert stepped.moe is not None and stepped.moe.sparse_layers == (3,)
    assert ModelConfig.from_hf_config(_qwen3_moe_config(num_experts=0)).moe is None


@pytest.mark.parametrize(("overrides", "message"), [
    ({"shared_expert_intermediate_size": 256}, "shared experts"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"num_experts_per_tok": 9}, "9 experts per token with 8 experts"),
])
def test_unsupported_moe_variants_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(_qwen3_moe_config(**overrides))


def test_moe_config_without_expert_keys_names_the_key() -> None:
    cfg = _qwen3_moe_config()
    del cfg["moe_intermediate_size"]
    with pytest.raises(ValueError, match="lacks 'moe_intermediate_size'"):
        ModelConfig.from_hf_config(cfg)
