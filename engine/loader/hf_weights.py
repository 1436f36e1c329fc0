"""Weights from a Hugging Face directory: config.json plus *.safetensors (sharded or not).

Multimodal checkpoints whose text model we serve (Qwen3.5's
Qwen3_5ForConditionalGeneration) are read as that text model: the config from
text_config, the weights from model.language_model.* renamed to model.*; the
vision tower (model.visual.*) is skipped, as are MTP heads (mtp.*, also in
Qwen3-Next checkpoints) unless --spec mtp drafts with them, with one log line
saying so. The vision-language models (Qwen2.5-VL, Qwen3-VL) keep their own
architecture name, their text fields read from text_config or, in Qwen2.5-VL's
original config.json, the top level; their towers (visual.* or model.visual.*,
is_vision_tensor) are skipped here and loaded by the vision side.

FP8 checkpoints (quantization_config quant_method "fp8", e4m3, dynamic
activations: Qwen3's FP8 releases) pair each FP8 `<name>.weight` with its
`<name>.weight_scale_inv` (128 x 128 block scales) or `<name>.weight_scale`
(one per tensor); the scales are consumed here, never yielded on their own.
A tensor the load keeps in FP8 (fp8_kept, set by load_model from
engine/loader/packing.py's plan) comes as an Fp8Rows; any other comes
dequantized to float32 (value * scale, exact for the engine's copy).
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

from engine.execution.fp8_weight import Fp8Rows
from engine.loader.pooling import sentence_transformers_pooling
from engine.models.config import ModelConfig
from engine.models.vision.weights import VISION_PREFIXES, vision_prefix
from kernels.fp8_reference import FP8, block_scales_of_tensor, dequantize, scale_shape

_INDEX_FILE = "model.safetensors.index.json"
log = logging.getLogger(__name__)

# Multimodal architecture -> the text model class its text_config describes.
_TEXT_BACKBONES = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
# Vision-language architectures served under their own name (engine/models/qwen_vl.py).
_VISION_LANGUAGE = frozenset({"Qwen2_5_VLForConditionalGeneration",
                              "Qwen3VLForConditionalGeneration"})
_LANGUAGE_MODEL_PREFIX = "model.language_model."
# Prefix -> what it holds, for tensors the text model does not use.
_SKIPPED_PREFIXES = {**dict.fromkeys(VISION_PREFIXES, "vision tower"),
                     "mtp.": "MTP head"}


def is_vision_tensor(stored_name: str) -> bool:
    """Whether a checkpoint tensor (its stored name) belongs to a vision
    tower, which the text load skips and the vision load reads."""
    return vision_prefix(stored_name) is not None


class HFCheckpoint:
    """A Hugging Face model directory: its ModelConfig and its safetensors tensors."""

    # Hugging Face checkpoints name each expert's matrices on their own.
    stacked_experts = False
    # The MTP head (mtp.*) is read only for --spec mtp (load_model sets this).
    keep_mtp = False
    # FP8 tensors (HF names) yielded in FP8 rather than dequantized (load_model).
    fp8_kept: frozenset[str] = frozenset()

    def __init__(self, directory: Path) -> None:
        self.path = directory
        raw = read_hf_config(directory)
        self.config = ModelConfig.from_hf_config(text_model_config(raw))
        self.files = safetensors_files(directory)
        self.size_bytes = sum(f.stat().st_size for f in self.files)
        self.pooling = sentence_transformers_pooling(directory)
        # Stored name of each FP8 weight -> stored name of its scale.
        self._fp8_scales = _fp8_scale_names(self.files) if is_fp8_checkpoint(raw) else {}
        self._scale_names = frozenset(self._fp8_scales.values())

    def fp8_tensors(self) -> frozenset[str]:
        """HF names of the tensors stored in FP8 (with a scale)."""
        return frozenset(_text_model_name(name) for name in self._fp8_scales)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor, float]]:
        """(HF name, CPU tensor as stored, fraction of bytes read)."""
        total = self.size_bytes or 1
        done = 0
        skipped: Counter[str] = Counter()
        for file in self.files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for stored in handle.keys():
                    if stored in self._scale_names:
                        continue  # read with its weight
                    name = _text_model_name(stored)
                    part = None if self.keep_mtp and name.startswith("mtp.") \
                        else _skipped_part(name)
                    if part is not None:
                        skipped[part] += 1
                        continue
                    if _is_ignored(name, self.config):
                        continue
                    tensor = handle.get_tensor(stored)
                    done += tensor.nbytes
                    if stored in self._fp8_scales:
                        tensor = self._fp8_tensor(name, stored, tensor)
                    elif tensor.dtype == FP8:
                        raise ValueError(f"{self.path.name}: {stored} is stored in FP8 without "
                                         "a weight_scale_inv or weight_scale beside it")
                    yield name, tensor, min(done / total, 1.0)
        if skipped:
            log.info("%s: skipped %s (not used by the text model)", self.path.name,
                     ", ".join(f"{count} {part} tensors" for part, count in skipped.items()))


    def _fp8_tensor(self, name: str, stored: str, values: torch.Tensor) -> Fp8Rows | torch.Tensor:
        """An FP8 weight with its block scales: as they are where the load
        keeps it in FP8, else dequantized to float32."""
        scale = _read_tensor(self.files, self._fp8_scales[stored])
        n, k = values.shape
        if scale.dim() == 2 and tuple(scale.shape) == scale_shape(n, k):
            scales = scale.float().contiguous()
        elif scale.numel() == 1:
            scales = block_scales_of_tensor(scale, n, k)
        else:
            raise ValueError(f"{self.path.name}: {self._fp8_scales[stored]} has shape "
                             f"{tuple(scale.shape)}; only 128x128 block scales "
                             f"{scale_shape(n, k)} or one per tensor are supported")
        if name in self.fp8_kept:
            return Fp8Rows(values, scales)
        return dequantize(values, scales)


def is_fp8_checkpoint(cfg: dict[str, Any]) -> bool:
    """Whether config.json describes an FP8 checkpoint we serve; ValueError
    naming what is not supported for any other quantization_config."""
    quant = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get(
        "quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method {method!r} is not supported; "
                         "served: unquantized checkpoints, FP8 (quant_method 'fp8') and "
                         "GGUF files")
    fmt = quant.get("fmt", "e4m3")
    scheme = quant.get("activation_scheme", "dynamic")
    block = quant.get("weight_block_size")
    if fmt != "e4m3":
        raise ValueError(f"FP8 format {fmt!r} is not supported; only e4m3 is")
    if scheme != "dynamic":
        raise ValueError(f"FP8 activation_scheme {scheme!r} (static input scales) is not "
                         "supported; only 'dynamic' checkpoints are")
    if block is not None and list(block) != [128, 128]:
        raise ValueError(f"FP8 weight_block_size {block} is not supported; only [128, 128] "
                         "blocks or one scale per tensor are")
    return True


def _fp8_scale_names(files: list[Path]) -> dict[str, str]:
    """Stored name of each weight that has a scale beside it -> the scale's."""
    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            names.update(handle.keys())
    found = {}
    for name in names:
        for suffix in (".weight_scale_inv", ".weight_scale"):
            if name.endswith(suffix):
                weight = name.removesuffix(suffix) + ".weight"
                if weight in names:
                    found[weight] = name
    return found


def _read_tensor(files: list[Path], name: str) -> torch.Tensor:
    """One tensor by its stored name, from whichever file holds it."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    raise ValueError(f"no safetensors file holds {name}")


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
    if architectures and architectures[0] in _VISION_LANGUAGE:
        return _vision_language_text_config(cfg)
    backbone = _TEXT_BACKBONES.get(architectures[0]) if architectures else None
    if backbone is None:
        return cfg
    if "text_config" not in cfg:
        raise ValueError(f"config.json of a {architectures[0]} has no text_config")
    text = {**cfg["text_config"], "architectures": [backbone]}
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def _vision_language_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A VL config's text fields under its own architecture name: text_config
    over the top level (Qwen2.5-VL's original config.json has them only
    there), with the top level's tie_word_embeddings (it ties the top-level
    lm_head)."""
    top = {key: value for key, value in cfg.items() if key not in ("text_config", "vision_config")}
    text = {**top, **(cfg.get("text_config") or {}), "architectures": cfg["architectures"]}
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
