"""The torch dequantizer of packed GGUF blocks (kernels/gguf_reference.py)
against gguf's own: bit-equal float32 for every type we serve packed."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kernels import gguf_reference
from tests.engine.quantized_gguf import random_blocks

TYPES = [T.Q4_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_dequantize_as_gguf_does(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    rows, cols = 7, 1024
    packed = random_blocks(rng, qtype, rows, cols)
    # Scales of every size, negative ones too (Q4_0/Q8_0/Q6_K's d may be).
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = packed.reshape(rows, -1, size)
    offset = 208 if qtype == T.Q6_K else 0
    wide = rng.standard_normal((rows, cols // block)).astype(np.float16) * np.float16(3)
    blocks[:, ::3, offset:offset + 2] = wide[:, ::3, None].view(np.uint8).reshape(rows, -1, 2)
    expected = gguf.quants.dequantize(packed, qtype)
    got = gguf_reference.dequantize(torch.from_numpy(packed), int(qtype), cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0], ids=lambda t: t.name)
def test_gguf_quantized_matrices_dequantize_as_gguf_does(qtype: T) -> None:
    floats = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    packed = gguf.quants.quantize(floats, qtype)
    got = gguf_reference.dequantize(torch.from_numpy(packed), int(qtype), 256)
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(packed, qtype)))


def test_row_bytes_and_whole_blocks() -> None:
    for qtype in TYPES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert gguf_reference.row_bytes(int(qtype), 4 * 256) == 4 * 256 // block * size
    with pytest.raises(ValueError, match="whole blocks of 256"):
        gguf_reference.row_bytes(int(T.Q4_K), 128)
