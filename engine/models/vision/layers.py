"""The parts both vision towers are built from: norms, attention confined to
segments with a 2D rotary, the MLPs and the patch merger.

Weights are allocated empty on the target device (engine/models/weight_alloc.py)
and named by their checkpoint names through weight_destinations(prefix), as the
text models' are; the loader copies each tensor into its slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.vision.config import VisionTowerConfig
from engine.models.vision.grid import Segments
from engine.models.weight_alloc import empty_weight
from kernels.reference import rms_norm

NormKind = Literal["rms", "layer"]
Device = torch.device | str

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"vision hidden_act {name!r} is not supported; "
                         f"supported: {', '.join(sorted(_ACTIVATIONS))}") from None


class VisionRotary:
    """The towers' 2D rotary: the first half of each head's frequencies turn
    with the patch's row, the second half with its column, and the
    (row, column) angles fill the head twice, for rotate-half pairing."""

    def __init__(self, head_dim: int, theta: float) -> None:
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, 2] (row, column) -> float32 cos, sin [N, head_dim]."""
        angles = positions[..., None].float() * self.inv_freq.to(positions.device)
        angles = angles.flatten(1)  # [N, 2 * F]: the row's angles, then the column's
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated in float32, returned in x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      segments: Segments) -> torch.Tensor:
    """Bidirectional attention within each segment. q, k, v: [N, heads, D].

    On a GPU each group of equal-length segments is one torch
    scaled_dot_product_attention call over [runs, heads, length, D] with no
    mask, so it can take the flash kernel (see Segments for why not one
    masked call); on the CPU the same groups run in float32 matmuls and a
    float32 softmax, the reference's math."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    for index in segments.groups:
        qg, kg, vg = (t[index].transpose(1, 2) for t in (q, k, v))  # [runs, heads, L, D]
        if q.is_cuda:
            attended = F.scaled_dot_product_attention(qg, kg, vg)
        else:
            scores = torch.matmul(qg.float(), kg.float().transpose(-1, -2)) * scale
            attended = torch.matmul(scores.softmax(dim=-1), vg.float()).to(q.dtype)
        out[index] = attended.transpose(1, 2)
    return out


class VisionNorm(nn.Module):
    """RMSNorm (Qwen2.5-VL: weight only) or LayerNorm (Qwen3-VL: weight and bias)."""

    def __init__(self, kind: NormKind, size: int, eps: float, device: Device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.size, self.eps = kind, size, eps
        self.weight = empty_weight((size,), device, dtype)
        self.bias = empty_weight((size,), device, dtype) if kind == "layer" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return rms_norm(x, self.weight, self.eps)
        return F.layer_norm(x, (self.size,), self.weight, self.bias, self.eps)

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        dests = {f"{prefix}.weight": self.weight}
        if self.bias is not None:
            dests[f"{prefix}.bias"] = self.bias
        return dests


class Linear(nn.Module):
    """A weight and a bias named as an nn.Linear's are in the checkpoint."""

    def __init__(self, out_features: int, in_features: int, device: Device,
                 dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.weight = empty_weight((out_features, in_features), device, dtype)
        self.bias = empty_weight((out_features,), device, dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        dests = {f"{prefix}.weight": self.weight}
        if self.bias is not None:
            dests[f"{prefix}.bias"] = self.bias
        return dests


class VisionAttention(nn.Module):
    """Fused q/k/v projection (with bias), 2D rotary, segment attention, output projection."""

    def __init__(self, config: VisionTowerConfig, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = Linear(3 * config.hidden_size, config.hidden_size, device, dtype)
        self.proj = Linear(config.hidden_size, config.hidden_size, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        attended = segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, segments)
        return self.proj(attended.flatten(1))

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        return {**self.qkv.weight_destinations(f"{prefix}.qkv"),
                **self.proj.weight_destinations(f"{prefix}.proj")}


class GatedMLP(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), every projection with a bias."""

    def __init__(self, config: VisionTowerConfig, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.act = activation(config.hidden_act)
        self.gate_proj = Linear(inner, hidden, device, dtype)
        self.up_proj = Linear(inner, hidden, device, dtype)
        self.down_proj = Linear(hidden, inner, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        return {key: value for name in ("gate_proj", "up_proj", "down_proj")
                for key, value in getattr(self, name).weight_destinations(f"{prefix}.{name}").items()}


class PlainMLP(nn.Module):
    """Qwen3-VL's: fc2(act(fc1(x))), with biases."""

    def __init__(self, config: VisionTowerConfig, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(config.hidden_act)
        self.linear_fc1 = Linear(config.intermediate_size, config.hidden_size, device, dtype)
        self.linear_fc2 = Linear(config.hidden_size, config.intermediate_size, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        return {**self.linear_fc1.weight_destinations(f"{prefix}.linear_fc1"),
                **self.linear_fc2.weight_destinations(f"{prefix}.linear_fc2")}


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, config: VisionTowerConfig, norm: NormKind, mlp: GatedMLP | PlainMLP,
                 device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = VisionNorm(norm, config.hidden_size, config.norm_eps, device, dtype)
        self.norm2 = VisionNorm(norm, config.hidden_size, config.norm_eps, device, dtype)
        self.attn = VisionAttention(config, device, dtype)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        return {**self.norm1.weight_destinations(f"{prefix}.norm1"),
                **self.norm2.weight_destinations(f"{prefix}.norm2"),
                **self.attn.weight_destinations(f"{prefix}.attn"),
                **self.mlp.weight_destinations(f"{prefix}.mlp")}


class PatchMerger(nn.Module):
    """merge_size**2 consecutive patches -> one output token: a norm (over each
    patch, or over the concatenation when norm_after_concat: Qwen3-VL's
    deepstack mergers), the concatenation, then Linear -> exact GELU -> Linear.

    names: the checkpoint's names of (norm, first linear, second linear):
    Qwen2.5-VL's ln_q / mlp.0 / mlp.2, Qwen3-VL's norm / linear_fc1 / linear_fc2.
    """

    def __init__(self, config: VisionTowerConfig, norm: NormKind, norm_after_concat: bool,
                 names: tuple[str, str, str], device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        self.concat_size = config.hidden_size * config.merge_unit
        self.norm_after_concat = norm_after_concat
        self.names = names
        norm_size = self.concat_size if norm_after_concat else config.hidden_size
        self.norm = VisionNorm(norm, norm_size, config.norm_eps, device, dtype)
        self.fc1 = Linear(self.concat_size, self.concat_size, device, dtype)
        self.fc2 = Linear(config.out_hidden_size, self.concat_size, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_concat:
            x = self.norm(x.view(-1, self.concat_size))
        else:
            x = self.norm(x).view(-1, self.concat_size)
        return self.fc2(F.gelu(self.fc1(x)))

    def weight_destinations(self, prefix: str) -> dict[str, torch.Tensor]:
        norm, fc1, fc2 = self.names
        return {**self.norm.weight_destinations(f"{prefix}.{norm}"),
                **self.fc1.weight_destinations(f"{prefix}.{fc1}"),
                **self.fc2.weight_destinations(f"{prefix}.{fc2}")}
