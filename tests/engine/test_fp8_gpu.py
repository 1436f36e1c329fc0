"""FP8 weights on CUDA (issue 19): a Hugging Face FP8 checkpoint loaded in
bfloat16 for our kernels keeps its projections in FP8 (one byte an element
plus block scales) and decodes the greedy tokens of the same checkpoint
loaded dequantized to bfloat16; --quantize fp8 does the same for a float
checkpoint, with about half the projections' bytes of bf16.

The models are tests/support/fp8_checkpoints.py's tiny Qwen3 (head size 64,
K of 256 and 384: whole 128-column blocks).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.execution.fp8_weight import Fp8Weight
from engine.execution.model_ops import CudaOps, make_ops
from engine.execution.quantized_weight import quantized_weights
from engine.loader import load_model
from engine.process import bootstrap
from engine.process.bootstrap import loaded_weights_bytes
from tests.engine.quantized_agreement import (
    AGREED_TOKENS,
    PROMPTS,
    agreed,
    assert_within_top5,
    greedy_tokens,
    reference_top5,
)
from tests.support.fp8_checkpoints import write_float_qwen3, write_fp8_copy

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
# q, k, v, o, gate, up, down of two layers.
PROJECTION_ELEMENTS = 2 * (2 * 65536 + 2 * 32768 + 3 * 98304)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("cupy")
    return write_float_qwen3(tmp_path_factory.mktemp("fp8-gpu") / "float")


@pytest.fixture(scope="module", params=["block", "tensor"])
def fp8_dir(request: pytest.FixtureRequest, float_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fp8_copy(float_dir, tmp_path_factory.mktemp(request.param) / "fp8",
                          per_tensor=request.param == "tensor")


def test_fp8_checkpoint_stays_fp8_on_the_device(fp8_dir: Path) -> None:
    loaded = load_model(fp8_dir, CUDA, torch.bfloat16)
    weights = quantized_weights(loaded.model)
    assert len(weights) == 8 and all(isinstance(w, Fp8Weight) for w in weights)
    plain = load_model(fp8_dir, CUDA, torch.bfloat16, packed_quant=False)
    assert not quantized_weights(plain.model)
    fp8_bytes = sum(w.nbytes for w in weights)
    assert loaded_weights_bytes(plain) - loaded_weights_bytes(loaded) \
        == 2 * PROJECTION_ELEMENTS - fp8_bytes


def test_linear_matches_the_dequantized_matrix(fp8_dir: Path) -> None:
    loaded = load_model(fp8_dir, CUDA, torch.bfloat16)
    ops = make_ops(loaded.config, CUDA, use_kernels=True, max_batch=8, max_context=256,
                   model=loaded.model)
    assert isinstance(ops, CudaOps) and ops.quant_scratch is not None
    for weight in (loaded.model.layers[0].self_attn.qkv_weight,
                   loaded.model.layers[1].mlp.down_weight):
        dense = weight.dequantize(torch.float32)
        for rows in (1, 3, 16, 64, 300):
            x = torch.randn(rows, weight.k, device=CUDA).to(torch.bfloat16)
            expected = F.linear(x.float(), dense)
            got = ops.linear(x, weight).float()
            assert (got - expected).abs().max().item() \
                <= 2e-2 * expected.abs().max().item() + 1e-3, rows
    # A scratch of one 128-row block: many-row products go a block at a time.
    qkv = loaded.model.layers[0].self_attn.qkv_weight
    ops.quant_scratch = torch.empty(qkv.k * 128, dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(300, qkv.k, device=CUDA).to(torch.bfloat16)
    expected = F.linear(x.float(), qkv.dequantize(torch.float32))
    assert (ops.linear(x, qkv).float() - expected).abs().max().item() \
        <= 2e-2 * expected.abs().max().item() + 1e-3


def test_greedy_tokens_agree_with_the_dequantized_model(
        fp8_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fp8 = greedy_tokens(fp8_dir)
    monkeypatch.setattr(bootstrap, "load_model", functools.partial(load_model,
                                                                   packed_quant=False))
    dequantized = greedy_tokens(fp8_dir)
    same = agreed(fp8, dequantized)
    print(f"{fp8_dir.parent.name}: tokens agreed before any divergence {same} of 16")
    # The same weights: the first tokens agree (ties aside), and every token
    # is among the dequantized model's best five.
    assert sum(same) >= AGREED_TOKENS * len(PROMPTS), (fp8, dequantized)
    assert_within_top5(fp8, reference_top5(fp8_dir, fp8))


def test_quantize_fp8_halves_the_projection_bytes(float_dir: Path) -> None:
    quantized = load_model(float_dir, CUDA, torch.bfloat16, quantize="fp8")
    plain = load_model(float_dir, CUDA, torch.bfloat16)
    weights = quantized_weights(quantized.model)
    assert len(weights) == 8 and not isinstance(quantized.model.lm_head, Fp8Weight)
    # 2 bytes an element -> 1, plus a float32 scale per 128x128 block.
    assert loaded_weights_bytes(plain) - loaded_weights_bytes(quantized) \
        == PROJECTION_ELEMENTS - 4 * 2 * 30


def test_quantize_fp8_serves_and_agrees_with_bf16(float_dir: Path) -> None:
    tokens = greedy_tokens(float_dir, quantize="fp8")
    plain = greedy_tokens(float_dir)
    same = agreed(tokens, plain)
    print(f"--quantize fp8: tokens agreed with bf16 before any divergence {same} of 16")
    # Quantized weights are other weights: every token among bf16's best five.
    assert_within_top5(tokens, reference_top5(float_dir, tokens))
