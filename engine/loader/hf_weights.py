"""Weights from a Hugging Face directory: config.json plus *.safetensors (sharded or not).

Multimodal checkpoints whose text model we serve (Qwen3.5's
Qwen3_5ForConditionalGeneration) are read as that text model: the config from
text_config, the weights from model.language_model.* renamed to model.*; the
vision tower (model.visual.*) is skipped, as are MTP heads (mtp.*, also in
Qwen3-Next checkpoints), with one log line saying so.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.loader.pooling import sentence_transformers_pooling
from engine.models.config import ModelConfig

_INDEX_FILE = "model.safetensors.index.json"
log = logging.getLogger(__name__)

# Multimodal architecture -> the text model class its text_config describes.
_TEXT_BACKBONES = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
_LANGUAGE_MODEL_PREFIX = "model.language_model."
# Prefix -> what it holds, for tensors no served model uses.
_SKIPPED_PREFIXES = {"model.visual.": "vision tower", "mtp.": "MTP head"}


class HFCheckpoint:
    """A Hugging Face model directory: its ModelConfig and its safetensors tensors."""

    # Hugging Face checkpoints name each expert's matrices on their own.
    stacked_experts = False

    def __init__(self, directory: Path) -> None:
        self.path = directory
        self.config = ModelConfig.from_hf_config(text_model_config(read_hf_config(directory)))
        self.files = safetensors_files(directory)
        self.size_bytes = sum(f.stat().st_size for f in self.files)
        self.pooling = sentence_transformers_pooling(directory)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor, float]]:
        """(HF name, CPU tensor as stored, fraction of bytes read)."""
        total = self.size_bytes or 1
        done = 0
        skipped: Counter[str] = Counter()
        for file in self.files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for stored in handle.keys():
                    name = _text_model_name(stored)
                    part = _skipped_part(name)
                    if part is not None:
                        skipped[part] += 1
                        continue
                    if _is_ignored(name, self.config):
                        continue
                    tensor = handle.get_tensor(stored)
                    done += tensor.nbytes
                    yield name, tensor, min(done / total, 1.0)
        if skipped:
            log.info("%s: skipped %s (not used by the text model)", self.path.name,
                     ", ".join(f"{count} {part} tensors" for part, count in skipped.items()))


def read_hf_config(directory: Path) -> dict[str, Any]:
    """config.json. Its token ids (and generation_config.json's) are not read
    here: end-of-sequence ids are the router's (router/text/model_text.py),
    sent with every request, so the two processes cannot disagree on them."""
    config_path = directory / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{directory} has no config.json; point at a Hugging Face model directory"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    return cfg


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as its text model's: a multimodal checkpoint's text_config
    under the text class's name (tie_word_embeddings is the top level's: it
    ties the top-level lm_head); any other config unchanged."""
    architectures = cfg.get("architectures") or []
    backbone = _TEXT_BACKBONES.get(architectures[0]) if architectures else None
    if backbone is None:
        return cfg
    if "text_config" not in cfg:
        raise ValueError(f"config.json of a {architectures[0]} has no text_config")
    text = {**cfg["text_config"], "architectures": [backbone]}
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def _text_model_name(name: str) -> str:
    if name.startswith(_LANGUAGE_MODEL_PREFIX):
        return "model." + name.removeprefix(_LANGUAGE_MODEL_PREFIX)
    return name


def _skipped_part(name: str) -> str | None:
    return next((part for prefix, part in _SKIPPED_PREFIXES.items()
                 if name.startswith(prefix)), None)


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files: those named by the shard index, else every *.safetensors."""
    index_path = directory / _INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"{directory}: shards listed in {_INDEX_FILE} are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{directory} has no *.safetensors weights; convert .bin/.pt checkpoints to safetensors "
            "or use a GGUF file"
        )
    return files


def _is_ignored(name: str, config: ModelConfig) -> bool:
    # Old checkpoints saved RoPE's inverse frequencies as buffers; some tied
    # checkpoints still carry a copy of the embedding as lm_head.
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"
