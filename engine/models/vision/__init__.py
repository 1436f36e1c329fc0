"""Vision towers of the vision-language models (images in, text out).

A tower turns an image's pixel patches (patches.py, from the router's
PreparedImage) into one embedding per merged patch group: the rows the text
model places at the image's placeholder tokens. Qwen2.5-VL (qwen2_5_vl.py:
RMSNorm blocks, windowed attention) and Qwen3-VL (qwen3_vl.py: LayerNorm
blocks, learned position table, deepstack features) share their attention,
rotary positions and merger (layers.py, grid.py). Every tower's forward takes
the patches and the images' (t, h, w) grids and returns (embeddings,
deepstack), deepstack being empty for Qwen2.5-VL, so the caller needs no
type test. Weights are named by their checkpoint names (weights.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.vision.config import VisionTowerConfig
from engine.models.vision.qwen2_5_vl import Qwen25VisionTower
from engine.models.vision.qwen3_vl import Qwen3VisionTower

VisionTower = Qwen25VisionTower | Qwen3VisionTower

_TOWERS: dict[str, type[Qwen25VisionTower] | type[Qwen3VisionTower]] = {
    "qwen2_5_vl": Qwen25VisionTower,
    "qwen3_vl": Qwen3VisionTower,
}


def build_vision_tower(hf_config: dict[str, Any], device: torch.device | str,
                       dtype: torch.dtype) -> VisionTower:
    """The empty tower (weights allocated, not filled) a config.json describes;
    weights.load_vision_weights fills it."""
    model_type = hf_config.get("model_type")
    tower_class = _TOWERS.get(str(model_type))
    if tower_class is None:
        raise ValueError(f"no vision tower for model_type {model_type!r}; "
                         f"supported: {', '.join(sorted(_TOWERS))}")
    if "vision_config" not in hf_config:
        raise ValueError(f"config.json of a {model_type} model has no vision_config")
    return build_tower(str(model_type), VisionTowerConfig.from_hf(hf_config["vision_config"]),
                       device, dtype)


def build_tower(family: str, config: VisionTowerConfig, device: torch.device | str,
                dtype: torch.dtype) -> VisionTower:
    """The empty tower of a family ("qwen2_5_vl", "qwen3_vl") and shape: a
    config.json's (build_vision_tower) or an mmproj GGUF's
    (engine/loader/gguf_mmproj.py)."""
    tower_class = _TOWERS.get(family)
    if tower_class is None:
        raise ValueError(f"no vision tower for {family!r}; supported: {', '.join(sorted(_TOWERS))}")
    return tower_class(config, device, dtype)


__all__ = ["VisionTower", "VisionTowerConfig", "build_tower", "build_vision_tower"]
