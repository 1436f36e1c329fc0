"""Packed GGUF matrices on CUDA (issue 19): a quantized GGUF loaded in bfloat16
for our kernels keeps its Q8_0 / K-quant projections in their blocks, holds
about the file's bytes for them on the device, and decodes the greedy tokens
of the same file loaded dequantized to bfloat16.

The models are tests/engine/quantized_gguf.py's tiny Llama files (head size
64, rows of whole 256-element blocks).
"""

from __future__ import annotations

import functools
import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

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
from tests.engine.quantized_gguf import MATRICES, Q4_K_M_MIX, tensor_bytes, write_quantized_gguf

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
MIXES = {"q8_0": {name: T.Q8_0 for name in MATRICES}, "q4_k_m": Q4_K_M_MIX}


@pytest.fixture(scope="module", params=sorted(MIXES))
def quantized_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Path:
    pytest.importorskip("kernels.gguf_quant")
    target = tmp_path_factory.mktemp("packed-gpu") / f"{request.param}.gguf"
    return write_quantized_gguf(target, MIXES[request.param])


def test_device_holds_the_packed_bytes(quantized_file: Path) -> None:
    # Engines of earlier tests still waiting for the collector would be
    # freed during the load and hide what it took.
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    loaded = load_model(quantized_file, CUDA, torch.bfloat16, gguf_packed=True)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(CUDA) - before
    weights = quantized_weights(loaded.model)
    assert len(weights) == 9, "every projection and the lm_head are packed"
    packed_bytes = sum(w.nbytes for w in weights)
    assert packed_bytes == tensor_bytes(quantized_file, set(MATRICES) - {"token_embd.weight"})
    held = loaded_weights_bytes(loaded)
    # The allocator rounds each tensor up to 512 bytes; nothing else stays.
    assert held <= grown <= held + 512 * 64
    plain = load_model(quantized_file, CUDA, torch.bfloat16, packed_quant=False)
    elements = sum(w.shape.numel() for w in weights)
    assert loaded_weights_bytes(plain) - held == 2 * elements - packed_bytes


def test_linear_matches_the_dequantized_matrix(quantized_file: Path) -> None:
    loaded = load_model(quantized_file, CUDA, torch.bfloat16, gguf_packed=True)
    ops = make_ops(loaded.config, CUDA, use_kernels=True, max_batch=8, max_context=256,
                   model=loaded.model)
    assert isinstance(ops, CudaOps) and ops.quant_scratch is not None
    qkv = loaded.model.layers[0].self_attn.qkv_weight
    dense = qkv.dequantize(torch.float32)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    for rows in (1, 3, 8, 64, 300):
        x = torch.randn(rows, qkv.k, device=CUDA, generator=generator).to(torch.bfloat16)
        expected = F.linear(x.float(), dense)
        got = ops.linear(x, qkv).float()
        tolerance = 2e-2 * expected.abs().max().item() + 1e-3
        assert (got - expected).abs().max().item() <= tolerance, rows
    # A scratch smaller than a segment: many-row products go a chunk of rows at a time.
    ops.quant_scratch = torch.empty(qkv.k * 40, dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(300, qkv.k, device=CUDA, generator=generator).to(torch.bfloat16)
    expected = F.linear(x.float(), dense)
    assert (ops.linear(x, qkv).float() - expected).abs().max().item() \
        <= 2e-2 * expected.abs().max().item() + 1e-3


def test_greedy_tokens_agree_with_the_dequantized_model(
        quantized_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = greedy_tokens(quantized_file, gguf_weights="packed")
    # The same engine options; the load dequantizes whatever they say.
    monkeypatch.setattr(bootstrap, "load_model", functools.partial(load_model,
                                                                   packed_quant=False))
    dequantized = greedy_tokens(quantized_file, gguf_weights="packed")
    same = agreed(packed, dequantized)
    print(f"{quantized_file.name}: tokens agreed before any divergence {same} of 16")
    # The same weights: the first tokens agree (near-ties of the random model
    # aside), and every packed token is among the dequantized model's best five.
    assert sum(same) >= AGREED_TOKENS * len(PROMPTS), (packed, dequantized)
    assert_within_top5(packed, reference_top5(quantized_file, packed, gguf_weights="packed"))
