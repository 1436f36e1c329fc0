"""A llama.cpp vision projector GGUF ("mmproj") as one of our vision towers:
its VisionTowerConfig from the clip.vision.* metadata and tensor shapes, and
its tensors under the Hugging Face names the towers' weight_destinations use.

llama.cpp's converter (convert_hf_to_gguf.py Qwen2VLVisionModel and
Qwen3VLVisionModel; names from gguf-py's MODEL_TENSOR table) writes:

| llama.cpp                        | Hugging Face (under visual.)                |
|----------------------------------|---------------------------------------------|
| v.patch_embd.weight, .weight.1   | patch_embed.proj.weight, frames 0 and 1 of the Conv3d kernel |
| v.patch_embd.bias                | patch_embed.proj.bias (Qwen3-VL)            |
| v.position_embd.weight           | pos_embed.weight (Qwen3-VL)                 |
| v.blk.N.attn_q / attn_k / attn_v | blocks.N.attn.qkv, split in thirds (Qwen2.5-VL) |
| v.blk.N.attn_qkv                 | blocks.N.attn.qkv (Qwen3-VL)                |
| v.blk.N.attn_out                 | blocks.N.attn.proj                          |
| v.blk.N.ln1, ln2                 | blocks.N.norm1, norm2                       |
| v.blk.N.ffn_gate / up / down     | blocks.N.mlp.gate_proj / up_proj / down_proj (Qwen2.5-VL) |
| v.blk.N.ffn_up / ffn_down        | blocks.N.mlp.linear_fc1 / linear_fc2 (Qwen3-VL) |
| v.post_ln, mm.0, mm.2            | merger.ln_q, mlp.0, mlp.2 (Qwen2.5-VL); merger.norm, linear_fc1, linear_fc2 (Qwen3-VL) |
| v.deepstack.L.norm / fc1 / fc2   | deepstack_merger_list.i.norm / linear_fc1 / linear_fc2, i the rank of vision layer L |

Settings the file leaves out are llama.cpp's: rope theta 10000, the window
of Qwen2.5-VL's windowed layers 112 pixels (clip.vision.window_size where a
file has it), full attention in every n_wa_pattern-th layer
((layer + 1) % n_wa_pattern == 0), the activation from clip.use_silu (SwiGLU)
/ clip.use_gelu (tanh GELU, transformers' gelu_pytorch_tanh) / neither
(quick GELU), one layer-norm epsilon for every norm.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from engine.loader.gguf_file import GGUFTensor, open_gguf
from engine.loader.gguf_weights import tensor_array
from engine.models.vision.config import VisionTowerConfig
from protocol.vision_gguf import TEMPORAL_PATCH_SIZE, mmproj_family

log = logging.getLogger(__name__)

# llama.cpp's defaults for what a Qwen mmproj does not say (tools/mtmd/clip.cpp).
LLAMA_CPP_ROPE_THETA = 10000.0
LLAMA_CPP_WINDOW_SIZE = 112
_DEFAULT_EPS = 1e-6
_BLOCK = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
_DEEPSTACK = re.compile(r"v\.deepstack\.(\d+)\.(norm|fc1|fc2)\.(weight|bias)")
_QKV_PARTS = ("attn_q", "attn_k", "attn_v")
_COMMON_BLOCK_NAMES = {"ln1": "norm1", "ln2": "norm2", "attn_out": "attn.proj",
                       "attn_qkv": "attn.qkv"}
# Per family: the MLP's names, then the merger's (v.post_ln, mm.0, mm.2).
_BLOCK_NAMES = {
    "qwen2_5_vl": {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                   "ffn_down": "mlp.down_proj"},
    "qwen3_vl": {"ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"},
}
_MERGER_NAMES = {
    "qwen2_5_vl": {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"},
    "qwen3_vl": {"v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1",
                 "mm.2": "merger.linear_fc2"},
}
_DEEPSTACK_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
PREFIX = "visual"


class MmprojCheckpoint:
    """One mmproj .gguf file: its tower family and config, and its tensors
    under "visual." Hugging Face names."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            opened = open_gguf(path)
        except (ValueError, OSError) as exc:
            raise ValueError(f"--mmproj {path} is not a readable GGUF file: {exc}") from None
        self.metadata: Mapping[str, Any] = opened.metadata
        self.family = mmproj_family(self.metadata, path.name)
        self._tensors = {tensor.name: tensor for tensor in opened.tensors}

    @cached_property
    def config(self) -> VisionTowerConfig:
        """The tower's shape (read when first asked for, so that a caller can
        check the pair's metadata first)."""
        return self._tower_config()

    def _value(self, key: str) -> Any:
        value = self.metadata.get(f"clip.vision.{key}")
        if value is None:
            raise ValueError(f"{self.path.name}: clip.vision.{key} is missing; the mmproj "
                             "is incomplete")
        return value

    def _shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape as numpy (and torch) order it: GGUF lists dims innermost first."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ValueError(f"{self.path.name} lacks tensor {name}; the mmproj is incomplete")
        return tuple(reversed(tensor.shape))

    def _tower_config(self) -> VisionTowerConfig:
        depth = int(self._value("block_count"))
        hidden, in_channels, patch, _ = self._shape("v.patch_embd.weight")
        if "v.patch_embd.weight.1" not in self._tensors:
            raise ValueError(f"{self.path.name} has one patch kernel (v.patch_embd.weight); "
                             "Qwen towers have two, one per frame (v.patch_embd.weight.1)")
        out_width = self._shape("mm.2.weight")[0]
        if out_width != int(self._value("projection_dim")):
            raise ValueError(f"{self.path.name}: mm.2 gives {out_width}-wide rows, "
                             f"clip.vision.projection_dim says {self._value('projection_dim')}")
        meta = self.metadata
        act = ("silu" if meta.get("clip.use_silu") else
               "gelu_pytorch_tanh" if meta.get("clip.use_gelu") else "quick_gelu")
        eps = meta.get("clip.vision.attention.layer_norm_epsilon")
        fields: dict[str, Any]
        if self.family == "qwen2_5_vl":
            fields = {"window_size": int(meta.get("clip.vision.window_size")
                                         or LLAMA_CPP_WINDOW_SIZE),
                      "fullatt_block_indexes": self._full_attention_layers(depth)}
        else:
            fields = {"num_position_embeddings": self._shape("v.position_embd.weight")[0],
                      "deepstack_visual_indexes": self._deepstack_layers(depth)}
        return VisionTowerConfig(
            depth=depth, hidden_size=hidden,
            intermediate_size=int(self._value("feed_forward_length")),
            num_heads=int(self._value("attention.head_count")), out_hidden_size=out_width,
            patch_size=patch, temporal_patch_size=TEMPORAL_PATCH_SIZE,
            merge_size=int(meta.get("clip.vision.spatial_merge_size") or 2),
            in_channels=in_channels, hidden_act=act, rope_theta=LLAMA_CPP_ROPE_THETA,
            norm_eps=_DEFAULT_EPS if eps is None else float(eps), **fields)

    def _full_attention_layers(self, depth: int) -> tuple[int, ...]:
        explicit = self.metadata.get("clip.vision.wa_layer_indexes")
        if explicit is not None:
            return tuple(sorted(int(i) for i in explicit))
        pattern = int(self._value("n_wa_pattern"))
        return tuple(layer for layer in range(depth) if (layer + 1) % pattern == 0)

    def _deepstack_layers(self, depth: int) -> tuple[int, ...]:
        """The vision layers with a deepstack merger: llama.cpp finds them by
        their tensors; clip.vision.is_deepstack_layers, where written, must agree."""
        layers = tuple(sorted({int(m.group(1)) for name in self._tensors
                               if (m := _DEEPSTACK.fullmatch(name))}))
        flags = self.metadata.get("clip.vision.is_deepstack_layers")
        if flags is not None:
            flagged = tuple(i for i, flag in enumerate(flags) if flag)
            if flagged != layers:
                raise ValueError(f"{self.path.name}: clip.vision.is_deepstack_layers names "
                                 f"layers {list(flagged)}, its tensors {list(layers)}")
        return layers

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name under "visual.", tensor) for every tower tensor;
        ValueError for one that has no place in the tower."""
        pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        patch: dict[str, torch.Tensor] = {}
        for name, tensor in self._tensors.items():
            value = _torch(tensor)
            if name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
                patch[name] = value
                if len(patch) == 2:  # [hidden, C, p, p] x 2 -> [hidden, C, 2, p, p]
                    yield f"{PREFIX}.patch_embed.proj.weight", torch.stack(
                        [patch["v.patch_embd.weight"], patch["v.patch_embd.weight.1"]], dim=2)
                continue
            block = _BLOCK.fullmatch(name)
            if block is not None and block.group(2) in _QKV_PARTS:
                layer, part, suffix = block.groups()
                parts = pending.setdefault((layer, suffix), {})
                parts[part] = value
                if len(parts) == 3:
                    yield (f"{PREFIX}.blocks.{layer}.attn.qkv.{suffix}",
                           torch.cat([parts[p] for p in _QKV_PARTS]))
                continue
            yield self._hf_name(name), value
        incomplete = [f"v.blk.{layer}.attn_q/k/v.{suffix}" for layer, suffix in pending
                      if len(pending[(layer, suffix)]) != 3]
        if incomplete:
            raise ValueError(f"{self.path.name} lacks part of {incomplete[0]}")

    def _hf_name(self, name: str) -> str:
        unknown = ValueError(f"{self.path.name}: tensor {name!r} has no place in a "
                             f"{self.family} vision tower")
        fixed = {"v.patch_embd.bias": "patch_embed.proj.bias",
                 "v.position_embd.weight": "pos_embed.weight"}
        if name in fixed:
            return f"{PREFIX}.{fixed[name]}"
        module, _, suffix = name.rpartition(".")
        if module in _MERGER_NAMES[self.family]:
            return f"{PREFIX}.{_MERGER_NAMES[self.family][module]}.{suffix}"
        block = _BLOCK.fullmatch(name)
        if block is not None:
            layer, part, suffix = block.groups()
            local = _COMMON_BLOCK_NAMES.get(part) or _BLOCK_NAMES[self.family].get(part)
            if local is None:
                raise unknown
            return f"{PREFIX}.blocks.{layer}.{local}.{suffix}"
        deepstack = _DEEPSTACK.fullmatch(name)
        if deepstack is not None:
            layer, part, suffix = deepstack.groups()
            if int(layer) not in self.config.deepstack_visual_indexes:
                raise unknown
            rank = self.config.deepstack_visual_indexes.index(int(layer))
            return f"{PREFIX}.deepstack_merger_list.{rank}.{_DEEPSTACK_NAMES[part]}.{suffix}"
        raise unknown


def _torch(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor in numpy's (row-major) shape, as float (F16 kept in float16)."""
    array = tensor_array(tensor)
    return torch.from_numpy(array.reshape(tuple(reversed(tensor.shape))))
