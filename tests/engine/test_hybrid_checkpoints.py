"""Hybrid Qwen checkpoints as released: Qwen3.5's multimodal layout and MTP heads.

Qwen3.5 ships as Qwen3_5ForConditionalGeneration: config.json nests the text
model under text_config and the weights are model.language_model.* beside the
vision tower's model.visual.* and the MTP head's mtp.*. We serve the text
model: a tiny transformers Qwen3_5ForConditionalGeneration (with a vision
tower, plus mtp.* tensors added to its file as released checkpoints carry
them) must load and give transformers' greedy tokens on text. Qwen3-Next's
checkpoints also carry mtp.*: skipped too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader import load_model
from engine.models.config import ModelConfig
from engine.models.qwen3_next import Qwen3_5ForCausalLM
from tests.engine.test_hybrid_gguf import build_hf_model
from tests.engine.test_hybrid_models import (
    _COMMON,
    NEW_TOKENS,
    TOL,
    HybridRunner,
    _hf_logits,
    _max_diff,
    _prompt,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
               patch_size=4, num_position_embeddings=16)


def _add_mtp_tensors(directory: Path, hidden: int) -> None:
    """A few of a released checkpoint's MTP head tensors, added to its file."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
    tensors["mtp.norm.weight"] = torch.zeros(hidden)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(hidden)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3_5Config(
        text_config={**_COMMON, "num_hidden_layers": 3, "full_attention_interval": 3},
        vision_config=_VISION, tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")):
                param.add_(torch.randn(param.shape) * 0.2)
    directory = tmp_path_factory.mktemp("qwen3_5_multimodal")
    model.save_pretrained(directory, safe_serialization=True)
    _add_mtp_tensors(directory, _COMMON["hidden_size"])
    return directory, model


def test_checkpoint_is_what_released_ones_are(multimodal) -> None:
    directory, _ = multimodal
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    names = load_file(directory / "model.safetensors").keys()
    assert {name.split(".")[0] + "." + name.split(".")[1] for name in names} >= {
        "model.language_model", "model.visual", "mtp.fc"}


def test_config_is_the_text_models(multimodal) -> None:
    directory, _ = multimodal
    loaded = load_model(directory, CPU, torch.float32)
    text = {**json.loads((directory / "config.json").read_text())["text_config"],
            "architectures": ["Qwen3_5ForCausalLM"]}
    assert loaded.config == ModelConfig.from_hf_config(text, model_cls=Qwen3_5ForCausalLM)
    assert isinstance(loaded.model, Qwen3_5ForCausalLM)


def test_text_greedy_tokens_match_transformers(multimodal,
                                               caplog: pytest.LogCaptureFixture) -> None:
    directory, hf = multimodal
    with caplog.at_level(logging.INFO, logger="engine.loader.hf_weights"):
        ours = load_model(directory, CPU, torch.float32).model
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "vision tower" in skipped[0] and "3 MTP head" in skipped[0]
    prompt = _prompt(3)
    runner = HybridRunner(ours)
    prefill = runner.logits([(0, prompt)])
    diff = _max_diff(prefill, _hf_logits(hf, prompt))
    assert diff < TOL, f"max |logit diff| {diff:.2e}"
    tokens = [int(prefill[-1].argmax())]
    while len(tokens) < NEW_TOKENS:
        tokens.append(int(runner.logits([(0, tokens[-1:])])[-1].argmax()))
    expected: list[int] = []
    while len(expected) < NEW_TOKENS:
        expected.append(int(_hf_logits(hf, prompt + expected)[-1].argmax()))
    assert tokens == expected


def test_qwen3_next_mtp_head_is_skipped(tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    build_hf_model("qwen3_next", tmp_path)
    _add_mtp_tensors(tmp_path, _COMMON["hidden_size"])
    with caplog.at_level(logging.INFO, logger="engine.loader.hf_weights"):
        load_model(tmp_path, CPU, torch.float32)
    assert "3 MTP head tensors" in caplog.text
