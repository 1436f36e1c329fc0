"""The vision-language checkpoints' config.json and preprocessor_config.json
at their released shapes (and tiny ones for the CPU smoke runs), for the
GPU vision benchmark (bench_gpu_vision.py).

Each is written in its release's own layout, since that is what a server is
pointed at: Qwen2.5-VL-7B-Instruct's text fields at the top level with
rope_scaling {"type": "mrope"} and the vision tower's in_chans; Qwen3-VL-8B-
Instruct's under text_config, its tower's under vision_config.
"""

from __future__ import annotations

import copy
from typing import Any

TOKEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
             "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
             "video_token_id": 151656}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

QWEN2_5_VL_7B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    **TOKEN_IDS, "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 128000, "max_window_layers": 28, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 152064,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
        "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2},
}
QWEN2_5_VL_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
}

QWEN3_VL_8B: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
    **{key: value for key, value in TOKEN_IDS.items() if key not in ("bos_token_id",
                                                                     "eos_token_id")},
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_vl_text", "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 262144,
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_theta": 5000000, "vocab_size": 151936,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                         "rope_type": "default"}},
    "vision_config": {
        "model_type": "qwen3_vl", "deepstack_visual_indexes": [8, 16, 24], "depth": 27,
        "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
        "intermediate_size": 4304, "num_heads": 16, "num_position_embeddings": 2304,
        "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2},
}
QWEN3_VL_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

# The smoke runs' shapes: text hidden 64 over 4 heads of 16 (M-RoPE sections
# of 8 frequencies), towers of 2 blocks 32 wide; the same layouts.
_TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 8192}
_TINY_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "out_hidden_size": 64}


def vision_language_config(arch: str, tiny: bool = False
                           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, preprocessor_config.json) of arch "qwen2_5_vl" (the 7B)
    or "qwen3_vl" (the 8B); tiny: the same with small widths and depths."""
    if arch == "qwen2_5_vl":
        cfg, processor = copy.deepcopy(QWEN2_5_VL_7B), dict(QWEN2_5_VL_PROCESSOR)
        if tiny:
            cfg.update(_TINY_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
            cfg["vision_config"].update(_TINY_VISION, window_size=56, fullatt_block_indexes=[1])
    elif arch == "qwen3_vl":
        cfg, processor = copy.deepcopy(QWEN3_VL_8B), dict(QWEN3_VL_PROCESSOR)
        if tiny:
            cfg["text_config"].update(_TINY_TEXT, rope_scaling={
                "mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"})
            cfg["vision_config"].update(_TINY_VISION, num_position_embeddings=64,
                                        deepstack_visual_indexes=[0, 1])
            # Images down to 112 x 112 (the smoke run's sizes).
            processor["size"] = {"longest_edge": 16777216, "shortest_edge": 3136}
    else:
        raise ValueError(f"unknown vision-language architecture {arch!r}: qwen2_5_vl or qwen3_vl")
    return cfg, processor
