"""The VisionSpec of a llama.cpp GGUF pair: a text model GGUF and its vision
projector ("mmproj") GGUF, as llama.cpp releases Qwen2.5-VL and Qwen3-VL.

Both processes read it through these functions, from the metadata that
protocol/gguf_file.py parses (plain key -> value mappings), so the router's
resize and the engine's patches and image-token checks cannot disagree.

What llama.cpp's files say, and what they leave to the reader (facts from
llama.cpp's convert_hf_to_gguf.py and tools/mtmd/clip.cpp):

- The mmproj's general.architecture is "clip"; clip.projector_type names the
  tower: "qwen2.5vl_merger" (Qwen2.5-VL, whose text GGUF is "qwen2vl") or
  "qwen3vl_merger" (Qwen3-VL, text "qwen3vl"). Others are refused.
- clip.vision.patch_size, image_mean and image_std are always written;
  clip.vision.spatial_merge_size only for Qwen3-VL (llama.cpp's default is 2);
  the temporal patch size is 2 (the converter splits the Conv3d kernel in
  its two frames and refuses any other).
- Pixel bounds: llama.cpp's Qwen projectors resize to between 8 and 4096
  image tokens, i.e. 8 and 4096 x (patch_size x merge_size)^2 pixels, and
  its converter writes no bounds. A file that carries
  clip.vision.image_min_pixels / image_max_pixels gets those.
- clip.vision.projection_dim is the text model's embedding width; Qwen3-VL's
  mmproj adds one such row per deepstack layer (clip.vision.is_deepstack_layers),
  which the text GGUF counts in <arch>.n_deepstack_layers.
- The image tokens are not in the mmproj: they are found by their text,
  <|image_pad|>, <|vision_start|> and <|vision_end|>, in the text GGUF's
  tokenizer.ggml.tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.vision import VisionSpec, VisionSpecError

# clip.projector_type -> (tower family, the text GGUF's general.architecture).
MMPROJ_PROJECTORS: dict[str, tuple[str, str]] = {
    "qwen2.5vl_merger": ("qwen2_5_vl", "qwen2vl"),
    "qwen3vl_merger": ("qwen3_vl", "qwen3vl"),
}
# VisionSpec token id field -> the token's text in Qwen vocabularies.
VISION_TOKEN_TEXTS: dict[str, str] = {
    "image_token_id": "<|image_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# llama.cpp's clip.cpp for the Qwen projectors: set_limit_image_tokens(8, 4096).
LLAMA_CPP_MIN_IMAGE_TOKENS = 8
LLAMA_CPP_MAX_IMAGE_TOKENS = 4096
LLAMA_CPP_MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2

_VISION = "clip.vision."


@dataclass(frozen=True)
class GGUFTextModel:
    """What pairing an mmproj needs of the text GGUF: read from its metadata
    once (the engine at load, the router from its metadata reader)."""

    source: str  # the file's name, for messages
    architecture: str  # general.architecture
    embedding_length: int
    deepstack_layers: int  # <arch>.n_deepstack_layers; 0 where absent, as llama.cpp
    # The vision tokens its vocabulary holds, by VisionSpec field.
    token_ids: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], source: str) -> GGUFTextModel:
        arch = str(metadata.get("general.architecture", ""))
        tokens = metadata.get("tokenizer.ggml.tokens") or ()
        return cls(source, arch, int(metadata.get(f"{arch}.embedding_length") or 0),
                   int(metadata.get(f"{arch}.n_deepstack_layers") or 0),
                   vision_token_ids(tokens))


def vision_token_ids(tokens: Sequence[str]) -> dict[str, int]:
    """The VisionSpec token fields whose text the vocabulary holds (the first
    id of each)."""
    wanted = {text: name for name, text in VISION_TOKEN_TEXTS.items()}
    found: dict[str, int] = {}
    for index, token in enumerate(tokens):
        name = wanted.get(token)
        if name is not None and name not in found:
            found[name] = index
    return found


def mmproj_family(mmproj: Mapping[str, Any], source: str) -> str:
    """The tower family ("qwen2_5_vl", "qwen3_vl") of an mmproj's metadata, or
    a VisionSpecError naming the file and why it is not one we read."""
    arch = mmproj.get("general.architecture")
    if arch != "clip":
        raise VisionSpecError(f"{source} is not a vision projector (mmproj) GGUF: its "
                              f"general.architecture is {arch!r}, not 'clip'")
    if mmproj.get("clip.has_vision_encoder") is False:
        raise VisionSpecError(f"{source} has no vision encoder (clip.has_vision_encoder is "
                              "false); images need one")
    projector = mmproj.get("clip.projector_type") or mmproj.get("clip.vision.projector_type")
    if projector not in MMPROJ_PROJECTORS:
        supported = ", ".join(f"{name} ({family})"
                              for name, (family, _) in MMPROJ_PROJECTORS.items())
        raise VisionSpecError(f"{source}: projector type {projector!r} is not supported; "
                              f"supported: {supported}")
    return MMPROJ_PROJECTORS[str(projector)][0]


def mmproj_deepstack_layers(mmproj: Mapping[str, Any]) -> int | None:
    """How many vision layers feed deepstack features (None: the file does not say)."""
    flags = mmproj.get(_VISION + "is_deepstack_layers")
    return None if flags is None else sum(bool(flag) for flag in flags)


def check_gguf_pair(text: GGUFTextModel, mmproj: Mapping[str, Any], mmproj_source: str) -> str:
    """The tower family of a text GGUF and mmproj that belong together; a
    VisionSpecError naming both files otherwise."""
    family = mmproj_family(mmproj, mmproj_source)
    projector_text = next(text_arch for fam, text_arch in MMPROJ_PROJECTORS.values()
                          if fam == family)
    vl_archs = sorted(text_arch for _, text_arch in MMPROJ_PROJECTORS.values())
    if text.architecture not in vl_archs:
        raise VisionSpecError(
            f"--mmproj {mmproj_source}: {text.source} is a {text.architecture!r} GGUF, not a "
            f"vision-language model this server reads images for ({', '.join(vl_archs)})")
    if text.architecture != projector_text:
        raise VisionSpecError(
            f"--mmproj {mmproj_source} is a {family} projector, which pairs with a "
            f"{projector_text!r} text GGUF; {text.source} is {text.architecture!r}")
    width = int(mmproj.get(_VISION + "projection_dim") or 0)
    if width != text.embedding_length:
        raise VisionSpecError(
            f"--mmproj {mmproj_source} projects images to {width}-wide embeddings; "
            f"{text.source} embeds tokens {text.embedding_length} wide: they are not a pair")
    deepstack = mmproj_deepstack_layers(mmproj)
    if deepstack is not None and deepstack != text.deepstack_layers:
        raise VisionSpecError(
            f"--mmproj {mmproj_source} has {deepstack} deepstack layers; {text.source} "
            f"takes {text.deepstack_layers} ({text.architecture}.n_deepstack_layers): "
            "they are not a pair")
    return family


def vision_spec_from_gguf(text: GGUFTextModel, mmproj: Mapping[str, Any],
                          mmproj_source: str) -> VisionSpec:
    """The VisionSpec of a checked pair (check_gguf_pair's errors first)."""
    check_gguf_pair(text, mmproj, mmproj_source)
    missing = [VISION_TOKEN_TEXTS[name] for name in VISION_TOKEN_TEXTS
               if name not in text.token_ids]
    if missing:
        raise VisionSpecError(f"{text.source}: the vocabulary has no {', '.join(missing)} "
                              "token; a Qwen vision-language model's prompts need it")
    patch = _required_int(mmproj, "patch_size", mmproj_source)
    merge = int(mmproj.get(_VISION + "spatial_merge_size") or LLAMA_CPP_MERGE_SIZE)
    token_pixels = (patch * merge) ** 2
    min_pixels = int(mmproj.get(_VISION + "image_min_pixels")
                     or LLAMA_CPP_MIN_IMAGE_TOKENS * token_pixels)
    max_pixels = int(mmproj.get(_VISION + "image_max_pixels")
                     or LLAMA_CPP_MAX_IMAGE_TOKENS * token_pixels)
    if not 0 < min_pixels <= max_pixels:
        raise VisionSpecError(f"{mmproj_source}: image_min_pixels ({min_pixels}) must be "
                              f"positive and at most image_max_pixels ({max_pixels})")
    return VisionSpec(
        patch_size=patch, merge_size=merge, temporal_patch_size=TEMPORAL_PATCH_SIZE,
        min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=_triple(mmproj, "image_mean", mmproj_source),
        image_std=_triple(mmproj, "image_std", mmproj_source),
        **dict(text.token_ids))


def _required_int(mmproj: Mapping[str, Any], key: str, source: str) -> int:
    value = mmproj.get(_VISION + key)
    if not isinstance(value, int) or value < 1:
        raise VisionSpecError(f"{source}: clip.vision.{key} is {value!r}; a positive "
                              "integer is needed")
    return value


def _triple(mmproj: Mapping[str, Any], key: str, source: str) -> tuple[float, float, float]:
    # As stored: GGUF keeps them in float32, which is also what the engine
    # normalises in, so the pixels are those of the preprocessor's decimals.
    value = mmproj.get(_VISION + key)
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise VisionSpecError(f"{source}: clip.vision.{key} must be three numbers, got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))
