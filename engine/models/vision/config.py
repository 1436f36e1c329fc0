"""A vision tower's shape, read once from config.json's vision_config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Defaults where a field is absent: transformers' Qwen2.5-VL / Qwen3-VL vision
# configs use these, and released config.json files omit some of them.
_DEFAULT_ROPE_THETA = 10000.0
_NORM_EPS = 1e-6  # fixed in both towers' code, never in config.json


@dataclass(frozen=True)
class VisionTowerConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    hidden_act: str
    rope_theta: float
    # Qwen2.5-VL: windowed attention except in fullatt_block_indexes.
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    # Qwen3-VL: learned position table (a square grid) and deepstack layers.
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()
    norm_eps: float = _NORM_EPS

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of "
                             f"num_heads {self.num_heads}")
        if self.head_dim % 4:
            # The 2D rotary splits each half of the head between h and w.
            raise ValueError(f"vision head_dim {self.head_dim} is not a multiple of 4")
        bad = [i for i in (*self.fullatt_block_indexes, *self.deepstack_visual_indexes)
               if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision layer indexes {bad} are outside depth {self.depth}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened input patch: channels x time x height x width."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token."""
        return self.merge_size * self.merge_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionTowerConfig:
        rope = cfg.get("rope_parameters") or {}
        return cls(
            depth=int(cfg["depth"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=int(cfg["num_heads"]),
            out_hidden_size=int(cfg["out_hidden_size"]),
            patch_size=int(cfg.get("patch_size", cfg.get("spatial_patch_size", 14))),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            merge_size=int(cfg.get("spatial_merge_size", 2)),
            # Released Qwen2.5-VL config.json files spell it in_chans.
            in_channels=int(cfg.get("in_channels", cfg.get("in_chans", 3))),
            hidden_act=str(cfg["hidden_act"]),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA))),
            window_size=int(cfg.get("window_size", 0)),
            fullatt_block_indexes=tuple(cfg.get("fullatt_block_indexes", ())),
            num_position_embeddings=int(cfg.get("num_position_embeddings", 0)),
            deepstack_visual_indexes=tuple(cfg.get("deepstack_visual_indexes", ())),
        )
