"""Small random-weight models with the real Qwen3 tokenizer and chat template.

Built with Hugging Face transformers (the reference implementation) and saved
as a Hugging Face directory (config.json, model.safetensors, tokenizer files),
exactly what a user would point Roundhouse at.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.fixtures import QWEN3_TOKENIZER_FILES, qwen3_tokenizer

# Qwen3's embedding has 151,936 rows; its tokenizer uses the first 151,669.
QWEN_VOCAB = 151936
QWEN_EOS = 151645  # <|im_end|>
QWEN_BOS = 151643  # <|endoftext|>

_SMALL = dict(
    vocab_size=QWEN_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    # Larger than the usual 0.02 so that logits are far apart and greedy
    # choices do not hinge on float rounding.
    initializer_range=0.1,
    bos_token_id=QWEN_BOS,
    eos_token_id=QWEN_EOS,
)


def _config(arch: str):
    import transformers

    if arch == "qwen3":
        return transformers.Qwen3Config(**_SMALL, head_dim=16, rope_theta=1_000_000.0,
                                        tie_word_embeddings=True)
    if arch == "qwen2":
        return transformers.Qwen2Config(**_SMALL, rope_theta=1_000_000.0, tie_word_embeddings=False)
    if arch == "llama":
        return transformers.LlamaConfig(**_SMALL, rope_theta=500_000.0, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        # Six layers, sparse where (layer + 1) % 2 == 0 except layer 3 (mlp_only_layers):
        # layers 1 and 5 route over 8 experts, the other four are dense MLPs.
        return transformers.Qwen3MoeConfig(
            **{**_SMALL, "num_hidden_layers": 6}, head_dim=16, rope_theta=1_000_000.0,
            tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3],
            norm_topk_prob=True)
    if arch == "qwen3_moe_all_sparse":
        # Experts in every layer, as llama.cpp's qwen3moe GGUFs have them.
        return transformers.Qwen3MoeConfig(
            **{**_SMALL, "num_hidden_layers": 3}, head_dim=16, rope_theta=1_000_000.0,
            tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "mixtral":
        # Experts of intermediate_size in every layer, top-2 of 4.
        return transformers.MixtralConfig(
            **{**_SMALL, "intermediate_size": 32}, rope_theta=1_000_000.0,
            tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)
    if arch in ("qwen3_5", "qwen3_next"):
        # Hybrids: Gated DeltaNet layers with every second layer gated attention.
        hybrid = dict(**{**_SMALL, "num_hidden_layers": 4}, head_dim=16,
                      tie_word_embeddings=False, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4,
                      full_attention_interval=2)
        if arch == "qwen3_next":
            return transformers.Qwen3NextConfig(
                **hybrid, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48)
        from transformers.models.qwen3_5 import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**hybrid)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def build_tiny_model(arch: str, target: Path, seed: int = 0) -> Path:
    """Write a random-weight model of `arch` ("qwen3", "qwen2", "llama", "qwen3_moe",
    "qwen3_moe_all_sparse", "mixtral", the hybrids "qwen3_5" and "qwen3_next")
    into target."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    model.eval()
    save_with_qwen3_tokenizer(model, target)
    return target


def save_with_qwen3_tokenizer(model: object, target: Path) -> None:
    """A transformers model saved into target (safetensors) beside the Qwen3
    tokenizer's files: a Hugging Face directory we can serve."""
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)  # type: ignore[attr-defined]
    source = qwen3_tokenizer()
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copyfile(source / name, target / name)
