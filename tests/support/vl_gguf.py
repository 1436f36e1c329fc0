"""The tiny Qwen-VL models (tiny_vl_models.py) as llama.cpp ships them: a
text GGUF and a vision projector ("mmproj") GGUF.

The layout follows llama.cpp's converter (convert_hf_to_gguf.py,
Qwen2VLVisionModel / Qwen3VLVisionModel / Qwen3VLTextModel, and gguf-py's
tensor names); nothing here is read back by the code under test, so a test
comparing both sides checks our reading of those facts:

- text: general.architecture qwen2vl (Qwen2.5-VL) or qwen3vl (Qwen3-VL), the
  Qwen2 / Qwen3 tensors (no q/k row permutation), rope.dimension_sections =
  mrope_section padded with zeros to four, qwen3vl.n_deepstack_layers, and
  the tokenizer as llama.cpp's gpt2 vocabulary (padded to vocab_size with
  [PAD<i>] tokens).
- mmproj: general.architecture clip, clip.projector_type qwen2.5vl_merger /
  qwen3vl_merger, clip.vision.* shapes, image_mean / image_std from
  preprocessor_config.json; the Conv3d patch kernel cut into its two
  temporal halves (v.patch_embd.weight, v.patch_embd.weight.1); Qwen2.5-VL's
  fused qkv split into attn_q / attn_k / attn_v (Qwen3-VL keeps attn_qkv);
  the merger as v.post_ln, mm.0, mm.2; Qwen3-VL's deepstack mergers named by
  the vision layer they follow (v.deepstack.<layer>.norm / fc1 / fc2).
  n_wa_pattern (Qwen2.5-VL) is fullatt_block_indexes[0] + 1.

Two keys llama.cpp's converter does not write for these projectors are
written unless asked not to: clip.vision.window_size (llama.cpp assumes 112)
and clip.vision.image_min_pixels / image_max_pixels (llama.cpp assumes 8 and
4096 image tokens), so that the tiny models' own values survive.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors import safe_open

from tests.engine.test_loaders import add_metadata, gguf_name

T = gguf.GGMLQuantizationType
_TEXT_ARCH = {"qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl"}
_PROJECTOR = {"qwen2_5_vl": "qwen2.5vl_merger", "qwen3_vl": "qwen3vl_merger"}
# HF tower names (after "visual.") -> llama.cpp's, per family.
_BLOCK_NAMES = {
    "norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "attn.qkv": "attn_qkv",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down",
}
_MERGER_NAMES = {"ln_q": "v.post_ln", "norm": "v.post_ln", "mlp.0": "mm.0", "mlp.2": "mm.2",
                 "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK_NAMES = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    with safe_open(hf_dir / "model.safetensors", framework="np") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _add_vocabulary(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    """The tokenizer.json vocabulary as llama.cpp's gpt2 tokenizer keys."""
    data = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for token, token_id in data["model"]["vocab"].items():
        tokens[token_id], types[token_id] = token, int(gguf.TokenType.NORMAL)
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(gguf.TokenType.CONTROL if added["special"]
                                 else gguf.TokenType.USER_DEFINED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in data["model"]["merges"]])
    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])


def write_text_gguf(hf_dir: Path, target: Path, matrices: T = T.F32) -> Path:
    """The language model of a tiny VL directory as llama.cpp's text GGUF;
    matrices: F32, or Q8_0 for every 2-D weight (norms stay F32, as
    llama.cpp's converter leaves 1-D tensors)."""
    config = json.loads((hf_dir / "config.json").read_text())
    text = config["text_config"]
    writer = gguf.GGUFWriter(target, _TEXT_ARCH[config["model_type"]])
    add_metadata(writer, text)
    sections = list(text["rope_parameters"]["mrope_section"])
    writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    if config["model_type"] == "qwen3_vl":
        writer.add_num_deepstack_layers(len(config["vision_config"]["deepstack_visual_indexes"]))
    _add_vocabulary(writer, hf_dir, text["vocab_size"])
    for name, array in sorted(_tensors(hf_dir).items()):
        if "visual." in name or (name == "lm_head.weight" and config["tie_word_embeddings"]):
            continue
        name = name.replace("model.language_model.", "model.")
        if matrices == T.Q8_0 and array.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, T.Q8_0),
                              raw_dtype=T.Q8_0)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    _finish(writer)
    return target


def _tower_tensors(name: str, array: np.ndarray, deepstack: list[int], split_qkv: bool
                   ) -> list[tuple[str, np.ndarray]]:
    """llama.cpp's tensors for one HF tower tensor (name after "visual.")."""
    if name == "patch_embed.proj.weight":  # [hidden, C, 2, p, p]: one conv per frame
        return [("v.patch_embd.weight", array[:, :, 0]), ("v.patch_embd.weight.1", array[:, :, 1])]
    if name == "patch_embed.proj.bias":
        return [("v.patch_embd.bias", array)]
    if name == "pos_embed.weight":
        return [("v.position_embd.weight", array)]
    module, suffix = name.rsplit(".", 1)
    if module.startswith("blocks."):
        _, layer, rest = module.split(".", 2)
        if rest == "attn.qkv" and split_qkv:
            q, k, v = np.split(array, 3, axis=0)
            return [(f"v.blk.{layer}.attn_{part}.{suffix}", piece)
                    for part, piece in zip("qkv", (q, k, v), strict=True)]
        return [(f"v.blk.{layer}.{_BLOCK_NAMES[rest]}.{suffix}", array)]
    if module.startswith("merger."):
        return [(f"{_MERGER_NAMES[module.split('.', 1)[1]]}.{suffix}", array)]
    if module.startswith("deepstack_merger_list."):
        _, index, part = module.split(".", 2)
        layer = deepstack[int(index)]
        return [(f"v.deepstack.{layer}.{_DEEPSTACK_NAMES[part]}.{suffix}", array)]
    raise ValueError(f"no llama.cpp name for vision tensor {name!r}")


def write_mmproj_gguf(hf_dir: Path, target: Path, *, matrices: T = T.F32,
                      pixel_bounds: bool = True, window_size: bool = True,
                      projector: str | None = None,
                      overrides: Mapping[str, Any] | None = None) -> Path:
    """The vision tower of a tiny VL directory (with its preprocessor_config.json)
    as llama.cpp's mmproj GGUF. matrices: F32, or F16 for the tensors of two
    or more dimensions but the position table (llama.cpp's usual mmproj-F16:
    norms, biases and v.position_embd stay F32); pixel_bounds / window_size:
    also write the keys llama.cpp's converter leaves out (see the module
    docstring); projector: another clip.projector_type; overrides: uint32
    keys written with other values (for tests of mismatched pairs)."""
    config = json.loads((hf_dir / "config.json").read_text())
    processor = json.loads((hf_dir / "preprocessor_config.json").read_text())
    vision, family = config["vision_config"], config["model_type"]
    overrides = dict(overrides or {})
    writer = gguf.GGUFWriter(target, "clip")

    def u32(key: str, value: int) -> None:
        writer.add_uint32(key, int(overrides.pop(key, value)))

    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_projector_type(projector or _PROJECTOR[family])
    writer.add_clip_has_vision_encoder(True)
    keys = gguf.Keys.ClipVision
    u32(keys.PROJECTION_DIM, config["text_config"]["hidden_size"])
    side = int(vision.get("num_position_embeddings", 0) ** 0.5)
    u32(keys.IMAGE_SIZE, side * vision["patch_size"] if side else 560)
    u32(keys.PATCH_SIZE, vision["patch_size"])
    u32(keys.EMBEDDING_LENGTH, vision["hidden_size"])
    u32(keys.FEED_FORWARD_LENGTH, vision["intermediate_size"])
    u32(keys.BLOCK_COUNT, vision["depth"])
    u32(keys.Attention.HEAD_COUNT, vision["num_heads"])
    writer.add_vision_image_mean(processor["image_mean"])
    writer.add_vision_image_std(processor["image_std"])
    writer.add_vision_attention_layernorm_eps(config["text_config"]["rms_norm_eps"])
    deepstack = list(vision.get("deepstack_visual_indexes", ()))
    if family == "qwen2_5_vl":
        writer.add_vision_use_silu(True)
        full = vision["fullatt_block_indexes"]
        u32(keys.N_WA_PATTERN, full[0] + 1)
        if window_size:
            u32(keys.WINDOW_SIZE, vision["window_size"])
    else:
        writer.add_vision_use_gelu(True)
        u32(keys.SPATIAL_MERGE_SIZE, vision["spatial_merge_size"])
        writer.add_vision_is_deepstack_layers([i in deepstack for i in range(vision["depth"])])
    if pixel_bounds:
        u32(keys.IMAGE_MIN_PIXELS, processor["min_pixels"])
        u32(keys.IMAGE_MAX_PIXELS, processor["max_pixels"])
    for key, value in overrides.items():  # keys the converter would not write at all
        writer.add_uint32(key, int(value))
    for name, array in sorted(_tensors(hf_dir).items()):
        if "visual." not in name:
            continue
        local = name.split("visual.", 1)[1]
        for gguf_tensor, piece in _tower_tensors(local, array, deepstack,
                                                 split_qkv=family == "qwen2_5_vl"):
            if matrices == T.F16 and piece.ndim >= 2 and "position_embd" not in gguf_tensor:
                piece = piece.astype(np.float16)
            writer.add_tensor(gguf_tensor, np.ascontiguousarray(piece))
    _finish(writer)
    return target


def float32_values(record: Any, *names: str) -> Any:
    """record (a frozen dataclass) with the named float fields (or tuples of
    floats) rounded to float32, as a GGUF file stores them."""
    def rounded(value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(float(np.float32(v)) for v in value)
        return float(np.float32(value))

    return dataclasses.replace(record, **{name: rounded(getattr(record, name)) for name in names})


def write_vl_gguf_pair(hf_dir: Path, directory: Path, matrices: T = T.F32,
                       **mmproj_options: Any) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) in directory, named as llama.cpp's releases are."""
    directory.mkdir(parents=True, exist_ok=True)
    suffix = "Q8_0" if matrices == T.Q8_0 else "F32"
    text = write_text_gguf(hf_dir, directory / f"model-{suffix}.gguf", matrices)
    mmproj = write_mmproj_gguf(hf_dir, directory / "mmproj-model-F32.gguf", **mmproj_options)
    return text, mmproj
