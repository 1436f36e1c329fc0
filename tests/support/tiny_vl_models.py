"""Small random-weight Qwen2.5-VL and Qwen3-VL models (transformers' own
classes) with the Qwen3 tokenizer files, saved as Hugging Face directories.

Text side as tests/support/tiny_models.py's: hidden 64, 4 heads over 2 KV
heads of 16 dims, so the multimodal RoPE sections cover 8 frequencies.
Vision towers of two blocks, 32 wide, merging 2 x 2 patches.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.tiny_models import QWEN_BOS, QWEN_EOS, QWEN_VOCAB, save_with_qwen3_tokenizer

# Token ids both configs (and the Qwen tokenizers) use.
IMAGE_TOKEN = 151655  # <|image_pad|>
VISION_START = 151652  # <|vision_start|>
VISION_END = 151653  # <|vision_end|>
MERGE_SIZE = 2

_TEXT = dict(
    vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=QWEN_BOS, eos_token_id=QWEN_EOS,
)
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
               spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, initializer_range=0.1)


def tiny_vl_config(arch: str):
    """arch "qwen2_5_vl" (contiguous M-RoPE sections [2, 3, 3]) or "qwen3_vl"
    (interleaved [4, 2, 2], deepstack features from both vision blocks)."""
    import transformers

    if arch == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                     "mrope_section": [2, 3, 3]}),
            vision_config=dict(_VISION, patch_size=14, window_size=56, fullatt_block_indexes=[1]),
            image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, tie_word_embeddings=False)
    if arch == "qwen3_vl":
        return transformers.Qwen3VLConfig(
            text_config=dict(_TEXT, head_dim=16, rope_parameters={
                "rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2],
                "mrope_interleaved": True}),
            vision_config=dict(_VISION, patch_size=16, num_position_embeddings=64,
                               deepstack_visual_indexes=[0, 1]),
            image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, tie_word_embeddings=True)
    raise ValueError(f"unknown tiny vision-language architecture {arch!r}")


def build_tiny_vl_model(arch: str, target: Path, seed: int = 0, config=None):
    """Save a random-weight model of arch (or of config, one of tiny_vl_config's
    changed) into target; returns the model (float32, eval)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(
        config if config is not None else tiny_vl_config(arch), dtype=torch.float32)
    model.eval()
    save_with_qwen3_tokenizer(model, target)
    return model
