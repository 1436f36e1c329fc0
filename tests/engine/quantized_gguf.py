"""Tiny Llama GGUF files with quantized matrices, as llama.cpp's quantizer leaves them.

Q8_0 and Q4_0/Q5_0 tensors come from gguf's own quantizers. gguf cannot
quantize to K-quants, so those tensors are random blocks with sane scales:
any bytes are a valid K-quant block once its float16 scales are finite, and
the model they make is as good a random model as any. Shapes are multiples
of 256 where K-quants need it (every row holds whole 256-element blocks).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from tests.engine.test_loaders import add_metadata

CONFIG = {
    "num_hidden_layers": 2,
    "max_position_embeddings": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0},
    "vocab_size": 384,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# llama.cpp's names of the matrices, and their shapes [rows, cols].
def _matrices() -> dict[str, tuple[int, int]]:
    c = CONFIG
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes = {"token_embd.weight": (c["vocab_size"], hidden),
              "output.weight": (c["vocab_size"], hidden)}
    for layer in range(c["num_hidden_layers"]):
        blk = f"blk.{layer}"
        shapes.update({
            f"{blk}.attn_q.weight": (q, hidden), f"{blk}.attn_k.weight": (kv, hidden),
            f"{blk}.attn_v.weight": (kv, hidden), f"{blk}.attn_output.weight": (hidden, q),
            f"{blk}.ffn_gate.weight": (inter, hidden), f"{blk}.ffn_up.weight": (inter, hidden),
            f"{blk}.ffn_down.weight": (hidden, inter),
        })
    return shapes


MATRICES = _matrices()

# A Q4_K_M-like mix: Q4_K but for v, down and the output (Q6_K).
Q4_K_M_MIX = {name: (T.Q6_K if any(part in name for part in ("attn_v", "ffn_down", "output"))
                     else T.Q4_K) for name in MATRICES}


def random_blocks(rng: np.random.Generator, qtype: T, rows: int, cols: int) -> np.ndarray:
    """Random bytes of rows x cols elements in qtype, with finite, small
    float16 scales (d and dmin) so the weights are of a usual size."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale_offsets = {T.Q6_K: (208,), T.Q4_K: (0, 2), T.Q5_K: (0, 2)}.get(qtype, (0,))
    magnitude = {T.Q6_K: 2e-4, T.Q4_K: 1.5e-3, T.Q5_K: 8e-4}.get(qtype, 1e-2)
    for offset in scale_offsets:
        scales = rng.uniform(0.5, 1.0, size=(rows, cols // block)) * magnitude
        raw[:, :, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(
            rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def write_quantized_gguf(target: Path, types: dict[str, T], seed: int = 0) -> Path:
    """A tiny Llama GGUF: each matrix in types[name] (F32 where absent), norms F32."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(target, "llama")
    add_metadata(writer, CONFIG)
    hidden = CONFIG["hidden_size"]
    for layer in range(CONFIG["num_hidden_layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight",
                              (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for name, (rows, cols) in MATRICES.items():
        qtype = types.get(name, T.F32)
        if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
            writer.add_tensor(name, random_blocks(rng, qtype, rows, cols), raw_dtype=qtype)
            continue
        floats = (0.08 * rng.standard_normal((rows, cols))).astype(np.float32)
        if qtype == T.F32:
            writer.add_tensor(name, floats)
        else:
            writer.add_tensor(name, gguf.quants.quantize(floats, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def tensor_bytes(path: Path, names: set[str] | None = None) -> int:
    """Bytes of the file's tensors (those named, or all)."""
    reader = gguf.GGUFReader(path)
    return sum(int(t.n_bytes) for t in reader.tensors if names is None or t.name in names)
