"""Qwen3 checkpoints at real shapes whose weights are all zeros, written as
sparse files: a safetensors header and a hole. They cost no disk and no time
to write, and loading them reads zero pages. Memory planning, lifecycles and
throughput do not depend on the weights' values (every logit is 0, so greedy
decoding repeats token 0), which makes them the right stand-in for many big
models on one GPU box.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

from tests.support.fixtures import QWEN3_TOKENIZER_FILES, qwen3_tokenizer

QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    "head_dim": 128, "num_key_value_heads": 8, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
# The published Qwen3 dense shapes, and a tiny one for checks on the CPU.
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "tie_word_embeddings": True},
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
}


def qwen3_config(shape: str, **overrides: Any) -> dict[str, Any]:
    return {**QWEN3_COMMON, **QWEN3_SHAPES[shape], **overrides}


def qwen3_tensor_shapes(config: dict[str, Any]) -> dict[str, list[int]]:
    """Every tensor of a Qwen3 checkpoint, by its Hugging Face name."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [vocab, hidden],
                                    "model.norm.weight": [hidden]}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [vocab, hidden]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes.update({
            prefix + "input_layernorm.weight": [hidden],
            prefix + "post_attention_layernorm.weight": [hidden],
            prefix + "self_attn.q_proj.weight": [q, hidden],
            prefix + "self_attn.k_proj.weight": [kv, hidden],
            prefix + "self_attn.v_proj.weight": [kv, hidden],
            prefix + "self_attn.o_proj.weight": [hidden, q],
            prefix + "self_attn.q_norm.weight": [head_dim],
            prefix + "self_attn.k_norm.weight": [head_dim],
            prefix + "mlp.gate_proj.weight": [inter, hidden],
            prefix + "mlp.up_proj.weight": [inter, hidden],
            prefix + "mlp.down_proj.weight": [hidden, inter],
        })
    return shapes


def write_sparse_safetensors(path: Path, shapes: dict[str, list[int]]) -> int:
    """A bf16 safetensors file of zeros; returns its (apparent) size."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + offset)
    return 8 + len(encoded) + offset


def write_sparse_qwen3(target: Path, shape: str, **overrides: Any) -> Path:
    """A Hugging Face directory with the real Qwen3 tokenizer and zero weights."""
    target.mkdir(parents=True, exist_ok=True)
    config = qwen3_config(shape, **overrides)
    (target / "config.json").write_text(json.dumps(config))
    write_sparse_safetensors(target / "model.safetensors", qwen3_tensor_shapes(config))
    source = qwen3_tokenizer()
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copy(source / name, target / name)
    return target
