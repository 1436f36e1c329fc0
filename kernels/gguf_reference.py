"""Torch reference dequantization of the GGUF (ggml) block formats we serve packed.

A packed matrix is the tensor's block bytes as the file stores them, one row
of blocks per output row: uint8 [N, row_bytes] for a float matrix [N, K].
dequantize() turns it back into float32 [N, K] with the same float32
products and sums, in the same order, as gguf.quants.dequantize (its numpy
code is the reference for llama.cpp's formats), so the two are bit-equal.
This is the CPU path of packed weights and what the CUDA kernels
(kernels/gguf_quant.py) are checked against.
"""

from __future__ import annotations

import torch

# gguf.GGMLQuantizationType ids of the formats below.
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 8, 12, 13, 14
# Per format: (elements per block, bytes per block), as in gguf.GGML_QUANT_SIZES.
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    Q4_0: (32, 18),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
}
TYPE_NAMES = {Q4_0: "Q4_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one packed row of k elements; ValueError if k is not whole blocks."""
    block, size = BLOCK_SIZES[qtype]
    if k % block:
        raise ValueError(f"a {TYPE_NAMES[qtype]} row holds whole blocks of {block} elements, "
                         f"not {k}")
    return k // block * size


def dequantize(packed: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 [N, row_bytes(qtype, k)] -> float32 [N, k], on packed's device."""
    assert packed.dtype == torch.uint8 and packed.dim() == 2, "packed rows are uint8 [N, bytes]"
    assert packed.shape[1] == row_bytes(qtype, k), "packed row size does not match k"
    size = BLOCK_SIZES[qtype][1]
    blocks = packed.contiguous().view(-1, size)
    values = _DEQUANTIZERS[qtype](blocks)
    return values.reshape(packed.shape[0], k)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte start of every block, as float32 [B, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, G, 32] bytes -> [B, G, 64]: the 32 low nibbles, then the 32 high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    qs = blocks[:, 2:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float() - 8
    return d * q


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return d * q


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block's 12 bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7,
    bytes 4-7 the same for the mins, bytes 8-11 the low nibbles of 4-7."""
    low, mid, high = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    scale = torch.cat((low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)), dim=-1)
    minimum = torch.cat((mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)), dim=-1)
    return scale.float(), minimum.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scale, minimum = _k_scales(blocks[:, 4:16])
    # Sub-block j of 32 elements: the low nibbles of qs[32 (j//2) : +32] for
    # even j, the high ones for odd j.
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return ((d * scale)[..., None] * q - (dmin * minimum)[..., None]).reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scale, minimum = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48]
    low = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # Bit j of qh[l] is the fifth bit of element l of sub-block j.
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device)
    high = (qh[:, None, :] >> shifts[None, :, None]) & 1
    q = (low | (high << 4)).float()
    return ((d * scale)[..., None] * q - (dmin * minimum)[..., None]).reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _half(blocks, 208)
    # Each half of 128 elements is four runs of 32: the low nibbles of ql's
    # first and second 32 bytes, then their high nibbles; run g takes its top
    # two bits from bits 2g, 2g+1 of the half's 32 qh bytes.
    halves = ql.reshape(-1, 2, 2, 32)
    low = torch.cat((halves & 0x0F, halves >> 4), dim=2)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    high = (qh.reshape(-1, 2, 1, 32) >> shifts[None, None, :, None]) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(-1, 16, 16)
    return ((d * scales)[..., None] * q).reshape(-1, 256)


_DEQUANTIZERS = {Q4_0: _q4_0, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}
