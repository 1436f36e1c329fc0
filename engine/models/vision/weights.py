"""Filling a vision tower from a checkpoint's tensors.

Checkpoints name the tower's tensors under one of two prefixes: Qwen2.5-VL
releases (and transformers 5.x's save_pretrained of
Qwen2_5_VLForConditionalGeneration) use "visual.", Qwen3-VL releases (and
transformers' Qwen3VLForConditionalGeneration) use "model.visual.".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.vision.qwen2_5_vl import Qwen25VisionTower
from engine.models.vision.qwen3_vl import Qwen3VisionTower

VISION_PREFIXES = ("model.visual.", "visual.")


def vision_prefix(name: str) -> str | None:
    """The tower prefix (without its dot) a checkpoint tensor name starts with, if any."""
    return next((prefix[:-1] for prefix in VISION_PREFIXES if name.startswith(prefix)), None)


def load_vision_weights(tower: Qwen25VisionTower | Qwen3VisionTower,
                        tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each vision tensor of a checkpoint into its slot of tower (others
    are passed over); every slot must be filled exactly once, with the
    config's shape."""
    destinations: dict[str, torch.Tensor] | None = None
    prefix = None
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            found = vision_prefix(name)
            if found is None:
                continue
            if destinations is None:
                prefix = found
                destinations = tower.weight_destinations(prefix)
            elif found != prefix:
                raise ValueError(f"the checkpoint names vision tensors under both {prefix}. "
                                 f"and {found}.")
            dest = destinations.get(name)
            if dest is None or name in filled:
                what = "twice" if name in filled else "for this config"
                raise ValueError(f"unexpected vision tensor {name!r} ({what}); the checkpoint "
                                 "does not match its vision_config")
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"vision tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the vision_config implies {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled.add(name)
    if destinations is None:
        raise ValueError("the checkpoint has no vision tower tensors (visual.* or model.visual.*)")
    missing = sorted(set(destinations) - filled)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} vision tensors "
                         f"(e.g. {', '.join(missing[:3])})")
