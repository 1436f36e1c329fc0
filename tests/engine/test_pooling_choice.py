"""Which pooling an engine reports for its embeddings: --pooling, else the
model's own sentence-transformers (or GGUF) setting, else last."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from engine.loader.pooling import gguf_pooling, sentence_transformers_pooling
from tests.engine import in_process


def sentence_transformers_dir(source: Path, target: Path, **flags: bool) -> Path:
    """A copy of a model directory with a sentence-transformers Pooling module."""
    shutil.copytree(source, target)
    (target / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]))
    (target / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
              "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
              "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False,
              "include_prompt": True, **flags}
    (target / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return target


def test_the_engine_reports_the_pooling_it_chose(tiny_qwen3_dir: Path, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    mean_model = sentence_transformers_dir(tiny_qwen3_dir, tmp_path / "st",
                                           pooling_mode_mean_tokens=True)
    with caplog.at_level(logging.INFO, logger="engine.process.bootstrap"):
        ready, _ = in_process.make_engine_and_ready(mean_model)
    assert ready.model.pooling == "mean"
    assert "mean pooling (the model's own configuration)" in caplog.text
    ready, _ = in_process.make_engine_and_ready(mean_model, pooling="cls")
    assert ready.model.pooling == "cls"
    ready, _ = in_process.make_engine_and_ready(tiny_qwen3_dir)
    assert ready.model.pooling == "last"


@pytest.mark.parametrize(("flags", "expected"), [
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_mean_tokens": True}, "mean"),
    # Not computed here: reported, and left to the default.
    ({"pooling_mode_max_tokens": True}, None),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, None),
    ({"pooling_mode": "lasttoken"}, "last"),
])
def test_sentence_transformers_configuration(flags: dict[str, object], expected: str | None,
                                             tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    directory = sentence_transformers_dir(tiny_qwen3_dir, tmp_path / "st", **flags)  # type: ignore[arg-type]
    assert sentence_transformers_pooling(directory) == expected


def test_a_plain_model_directory_names_no_pooling(tiny_qwen3_dir: Path) -> None:
    assert sentence_transformers_pooling(tiny_qwen3_dir) is None


def test_gguf_pooling_type() -> None:
    assert [gguf_pooling(value) for value in (None, 0, 1, 2, 3, 4)] == [
        None, None, "mean", "cls", "last", None]
