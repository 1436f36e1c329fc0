"""Tiny Hugging Face FP8 checkpoints, as the FP8 releases of Qwen3 store them.

write_float_qwen3 builds a random float32 Qwen3 at shapes our kernels take
(hidden 256, head size 64: every K a multiple of 128). write_fp8_copy turns
a float checkpoint's projections into float8 e4m3 `<name>.weight` plus
`<name>.weight_scale_inv` (128 x 128 block scales) or `<name>.weight_scale`
(one per tensor), with config.json's quantization_config; the quantization
here is written independently of the engine's (kernels/fp8_reference.py).
write_dequantized_copy writes the float checkpoint holding exactly the
values the FP8 one stands for.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = 128


def write_float_qwen3(target: Path, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.1,
        rope_theta=1_000_000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    return target


def is_projection(name: str) -> bool:
    return any(name.endswith(f".{kind}.weight") for kind in PROJECTIONS)


def _quantize(weight: torch.Tensor, per_tensor: bool,
              power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    if per_tensor:
        scale = weight.abs().max() / 448.0
        scale = 2.0 ** torch.ceil(torch.log2(scale)) if power_of_two else scale
        return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(()).float()
    rows, cols = -(-n // _BLOCK), -(-k // _BLOCK)
    scales = torch.empty(rows, cols)
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            block = weight[r * _BLOCK:(r + 1) * _BLOCK, c * _BLOCK:(c + 1) * _BLOCK]
            scale = block.abs().max() / 448.0
            scale = 2.0 ** torch.ceil(torch.log2(scale)) if power_of_two else scale
            scales[r, c] = scale
            values[r * _BLOCK:(r + 1) * _BLOCK, c * _BLOCK:(c + 1) * _BLOCK] = (
                block / scale).to(torch.float8_e4m3fn)
    return values, scales


def write_fp8_copy(source: Path, target: Path, *, per_tensor: bool = False,
                   power_of_two: bool = False, lm_head: bool = False) -> Path:
    """source's projections (and lm_head if asked) in FP8, everything else as stored."""
    target.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(source / "model.safetensors", framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            if is_projection(name) or (lm_head and name == "lm_head.weight"):
                values, scale = _quantize(tensor.float(), per_tensor, power_of_two)
                tensors[name] = values
                suffix = "weight_scale" if per_tensor else "weight_scale_inv"
                tensors[name.removesuffix("weight") + suffix] = scale
            else:
                tensors[name] = tensor.to(torch.bfloat16)
    save_file(tensors, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if not per_tensor:
        quant["weight_block_size"] = [_BLOCK, _BLOCK]
    config["quantization_config"] = quant
    (target / "config.json").write_text(json.dumps(config))
    return target


def write_dequantized_copy(fp8_dir: Path, target: Path) -> Path:
    """The float32 checkpoint of the values fp8_dir stands for (value * scale)."""
    target.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(fp8_dir / "model.safetensors", framework="pt") as handle:
        names = set(handle.keys())
        for name in names:
            if "weight_scale" in name:
                continue
            tensor = handle.get_tensor(name)
            base = name.removesuffix("weight")
            scale_name = next((base + s for s in ("weight_scale_inv", "weight_scale")
                               if base + s in names), None)
            if scale_name is not None:
                scale = handle.get_tensor(scale_name).float()
                if scale.dim() == 2:
                    scale = scale.repeat_interleave(_BLOCK, 0).repeat_interleave(_BLOCK, 1)
                    scale = scale[:tensor.shape[0], :tensor.shape[1]]
                tensor = tensor.float() * scale
            tensors[name] = tensor.float()
    save_file(tensors, target / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    (target / "config.json").write_text(json.dumps(config))
    for extra in fp8_dir.glob("*.json"):
        if extra.name != "config.json":
            shutil.copyfile(extra, target / extra.name)
    return target
