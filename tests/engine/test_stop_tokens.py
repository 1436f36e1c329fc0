"""End-of-sequence ids have one owner: the router's ModelText.

The model here disagrees with itself, as real checkpoints do: config.json
names one end token, generation_config.json two others (Llama 3 lists its
<|eot_id|> only there). The router reads generation_config.json first; the
engine derives nothing, and stops and ends grammars exactly on the ids the
router sends, so the two processes cannot disagree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.scheduling.core import EngineCore
from router.sampling import SamplingDefaults, SamplingRequest, build_params
from router.text.grammar_vocab import grammar_vocab
from router.text.model_text import ModelText
from tests.engine.in_process import SMALL_STEPS, make_engine, run_to_completion, step_outputs

IM_END, ENDOFTEXT = 151645, 151643
# What config.json claims ends a sequence: an ordinary token ("Hello").
CONFIG_EOS = 9707


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("stop-tokens") / "model"
    shutil.copytree(tiny_qwen3_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "eos_token_id": CONFIG_EOS}))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
    return target


def favour(core: EngineCore, monkeypatch: pytest.MonkeyPatch, plan: list[int]) -> None:
    """The model's favourite token at sampling step i is plan[i] (then its own)."""
    compute_logits = core.runner.model.compute_logits
    steps = [0]

    def biased(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        if steps[0] < len(plan):
            logits[:, plan[steps[0]]] += 1e4
        steps[0] += 1
        return logits

    monkeypatch.setattr(core.runner.model, "compute_logits", biased)


def test_the_engine_stops_only_on_the_routers_end_tokens(model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    text = ModelText.load(model_dir)
    assert text.eos_token_ids == (IM_END, ENDOFTEXT)
    core, events = make_engine(model_dir, **SMALL_STEPS)
    prompt = text.encode_prompt(text.render_chat([{"role": "user", "content": "Hi"}]))
    params = build_params(SamplingRequest(temperature=0.0), max_tokens=8,
                          defaults=SamplingDefaults(), eos_token_ids=text.eos_token_ids)
    # config.json's "end token" twice, then one the router sent.
    favour(core, monkeypatch, [CONFIG_EOS, CONFIG_EOS, ENDOFTEXT])
    outputs = step_outputs(run_to_completion(core, events, {"r": (prompt, params)}))
    tokens = [t for output in outputs for t in output.token_ids]
    assert tokens == [CONFIG_EOS, CONFIG_EOS, ENDOFTEXT]
    assert outputs[-1].finish_reason == "stop"


def test_grammars_end_on_the_routers_end_tokens(model_dir: Path) -> None:
    text = ModelText.load(model_dir)
    vocab = grammar_vocab(text)
    assert vocab.eos_token_ids == list(text.eos_token_ids)
    core, _ = make_engine(model_dir, **SMALL_STEPS)
    core.handle(vocab)
    compiler = core.grammar._compiler
    assert compiler is not None
    assert sorted(compiler.tokenizer_info.stop_token_ids) == sorted(text.eos_token_ids)


def test_the_engine_reports_no_token_ids_of_its_own() -> None:
    # The handshake carries no end-of-sequence ids for the router to weigh
    # against its own.
    assert not any("eos" in name or "bos" in name for name in p.ModelFacts.__struct_fields__)
