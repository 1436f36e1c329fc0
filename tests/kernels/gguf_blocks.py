"""Random packed GGUF weights for the quantized-kernel tests and benchmark.

Q8_0 and Q4_0 come from gguf's own quantizer (as a converted model's would).
gguf cannot quantize to K-quants, so their blocks are random bytes with
finite float16 scales: every such byte string is a valid block, and
gguf.quants.dequantize gives its exact values. Scales take both signs where
the format allows (d of Q8_0, Q4_0 and Q6_K; Q6_K's int8 sub-scales come
out of the random bytes), so a sign error shows.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

# Offsets of the float16 scales inside a K-quant block.
_K_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_packed(rng: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: rows x cols weights of about unit scale / sqrt(cols)."""
    qtype = T(qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (T.Q8_0, T.Q4_0):
        weights = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(cols**0.5)
        return gguf.quants.quantize(weights, qtype).reshape(rows, cols // block * size)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for i, offset in enumerate(_K_SCALE_OFFSETS[qtype]):
        scales = rng.uniform(0.5, 1.0, size=(rows, cols // block)) * 1e-2 / cols**0.5
        if qtype == T.Q6_K:
            scales *= rng.choice([-1.0, 1.0], size=scales.shape) / 32
        elif i == 1:
            scales *= 4  # dmin: the subtracted minimum, comparable to d * sc * q
        raw[:, :, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(
            rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def dequantized(packed: np.ndarray, qtype: int) -> np.ndarray:
    """gguf's float32 values of packed [rows, row_bytes] -> [rows, cols]."""
    return gguf.quants.dequantize(packed, T(qtype))
