"""Hugging Face FP8 checkpoints and --quantize fp8 on the CPU (issue 19).

An FP8 checkpoint (float8 e4m3 projections with 128x128 block scales, or one
scale per tensor) loads dequantized on the CPU: its logits are exactly those
of the float checkpoint holding value * scale. Forced on (packed_quant=True),
the FP8 slots (engine/execution/fp8_weight.py) run on the reference ops and
give the same logits too; --quantize fp8 likewise, against its own blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.execution.fp8_weight import Fp8Weight
from engine.execution.quantized_weight import quantized_weights
from engine.loader import load_model, open_checkpoint
from protocol import EngineOptions
from router.footprint import estimate_footprint, read_shape
from tests.engine.test_loaders import prefill_logits
from tests.support.fp8_checkpoints import (
    write_dequantized_copy,
    write_float_qwen3,
    write_fp8_copy,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
IDS = [1, 7, 300, 42, 9, 11, 500, 3]
# q, k, v, o, gate, up, down in each of two layers.
PROJECTIONS = 14


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_float_qwen3(tmp_path_factory.mktemp("fp8") / "float")


@pytest.fixture(scope="module", params=["block", "block-pow2", "tensor"])
def fp8_pair(request: pytest.FixtureRequest, float_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    fp8 = write_fp8_copy(float_dir, root / "fp8", per_tensor=request.param == "tensor",
                         power_of_two=request.param == "block-pow2")
    return fp8, write_dequantized_copy(fp8, root / "dequantized")


def test_fp8_checkpoint_gives_the_dequantized_logits(fp8_pair: tuple[Path, Path]) -> None:
    fp8, dequantized = fp8_pair
    checkpoint = open_checkpoint(fp8)
    assert len(checkpoint.fp8_tensors()) == PROJECTIONS
    loaded = load_model(fp8, CPU, torch.float32)  # every scale consumed: no unexpected tensor
    assert not quantized_weights(loaded.model), "the CPU load dequantizes"
    expected = prefill_logits(load_model(dequantized, CPU, torch.float32).model, IDS)
    assert torch.equal(prefill_logits(loaded.model, IDS), expected)


def test_fp8_slots_on_the_reference_ops_give_the_same_logits(
        fp8_pair: tuple[Path, Path]) -> None:
    fp8, dequantized = fp8_pair
    kept = load_model(fp8, CPU, torch.float32, packed_quant=True)
    weights = quantized_weights(kept.model)
    # qkv, o, gate_up, down per layer; lm_head stays float in these files.
    assert len(weights) == 8 and all(isinstance(w, Fp8Weight) for w in weights)
    assert kept.model.layers[0].self_attn.qkv_weight.part_rows == (256, 128, 128)
    assert kept.n_params == load_model(dequantized, CPU, torch.float32).n_params
    expected = prefill_logits(load_model(dequantized, CPU, torch.float32).model, IDS)
    assert torch.equal(prefill_logits(kept.model, IDS), expected)


def test_an_fp8_lm_head_is_kept_too(float_dir: Path, tmp_path: Path) -> None:
    fp8 = write_fp8_copy(float_dir, tmp_path / "fp8", lm_head=True)
    dequantized = write_dequantized_copy(fp8, tmp_path / "dequantized")
    kept = load_model(fp8, CPU, torch.float32, packed_quant=True)
    assert isinstance(kept.model.lm_head, Fp8Weight)
    expected = prefill_logits(load_model(dequantized, CPU, torch.float32).model, IDS)
    assert torch.equal(prefill_logits(kept.model, IDS), expected)


def test_quantize_fp8_quantizes_the_projections(float_dir: Path) -> None:
    quantized = load_model(float_dir, CPU, torch.float32, packed_quant=True, quantize="fp8")
    weights = quantized_weights(quantized.model)
    assert len(weights) == 8 and not isinstance(quantized.model.lm_head, Fp8Weight)
    plain = load_model(float_dir, CPU, torch.float32)
    # Each slot holds the float matrix quantized in 128x128 blocks.
    qkv = quantized.model.layers[1].self_attn.qkv_weight
    dense = plain.model.layers[1].self_attn.qkv_weight
    assert (qkv.dequantize() - dense).abs().max().item() <= dense.abs().max().item() / 16
    # The logits are those of the float model holding the dequantized blocks.
    with torch.no_grad():
        for name, module in quantized.model.named_modules():
            if isinstance(module, Fp8Weight):
                plain.model.get_parameter(name).copy_(module.dequantize())
    assert torch.equal(prefill_logits(quantized.model, IDS), prefill_logits(plain.model, IDS))


def test_quantize_fp8_is_refused_without_our_kernels(float_dir: Path) -> None:
    with pytest.raises(ValueError, match="--quantize fp8 needs our CUDA kernels"):
        load_model(float_dir, CPU, torch.float32, quantize="fp8")
    with pytest.raises(ValueError, match="--quantize 'int4' is not supported"):
        load_model(float_dir, CPU, torch.float32, quantize="int4")


def test_quantize_fp8_is_refused_for_gguf(tiny_model_factory, tmp_path: Path) -> None:
    from tests.engine.test_loaders import write_gguf

    path = write_gguf(tiny_model_factory("llama"), tmp_path / "m.gguf", "llama")
    with pytest.raises(ValueError, match="is a GGUF file, served in its own types"):
        load_model(path, CPU, torch.float32, quantize="fp8")


def _with_quant(source: Path, target: Path, quant: dict | None) -> Path:
    target.mkdir()
    (target / "model.safetensors").symlink_to(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quant
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("quant", "message"), [
    ({"quant_method": "fp8", "activation_scheme": "static"},
     "activation_scheme 'static' .* is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [1, 128]},
     r"weight_block_size \[1, 128\] is not supported"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
])
def test_unsupported_quantization_is_refused(fp8_pair: tuple[Path, Path], tmp_path: Path,
                                             quant: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(_with_quant(fp8_pair[0], tmp_path / "m", quant), CPU, torch.float32)


def test_fp8_tensors_without_scales_are_refused(fp8_pair: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    # Without quantization_config the scales go unread: an FP8 weight alone
    # must not be cast to float as if it were the weight.
    plain = _with_quant(fp8_pair[0], tmp_path / "m", None)
    with pytest.raises(ValueError, match="stored in FP8 without a weight_scale_inv"):
        load_model(plain, CPU, torch.float32)


def test_footprint_counts_fp8_bytes_on_the_gpu(fp8_pair: tuple[Path, Path],
                                               float_dir: Path) -> None:
    fp8, _ = fp8_pair
    # Per layer: q, o [256, 256], k, v [128, 256], gate, up [384, 256], down
    # [256, 384]; their 128x128 blocks: 4 + 4 + 2 + 2 + 6 + 6 + 6.
    elements, blocks = 2 * (2 * 65536 + 2 * 32768 + 3 * 98304), 2 * 30
    bf16 = EngineOptions(device="cuda", dtype="bfloat16")
    fp8_shape, float_shape = read_shape(fp8, "hf"), read_shape(float_dir, "hf")
    assert fp8_shape.packed_bytes == elements + 4 * blocks
    assert float_shape.fp8_quantizable_elements == elements
    float_weights = estimate_footprint(float_shape, bf16, cuda=True).weights_bytes
    # One byte an element instead of two, plus the float32 block scales.
    saved = elements - 4 * blocks
    assert float_weights - estimate_footprint(fp8_shape, bf16, cuda=True).weights_bytes == saved
    quantized = EngineOptions(device="cuda", dtype="bfloat16", quantize="fp8")
    assert float_weights - estimate_footprint(float_shape, quantized, cuda=True).weights_bytes \
        == saved
    # Off the GPU (and on the CPU) every tensor is held in the serving dtype.
    cpu = EngineOptions()
    scale_elements = fp8_shape.weight_elements - float_shape.weight_elements
    assert estimate_footprint(fp8_shape, cpu, cuda=False).weights_bytes \
        == estimate_footprint(float_shape, cpu, cuda=False).weights_bytes + 4 * scale_elements
