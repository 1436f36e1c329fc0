"""A vision-language model's image processor settings (VisionSpec), read from
its Hugging Face directory: the router resizes images by them and the engine
normalises and cuts them into patches by them.

The image processor settings come from preprocessor_config.json (what the
Hub's Qwen2.5-VL and Qwen3-VL repositories ship), or from the
"image_processor" entry of processor_config.json (what transformers 5 writes
when it saves a processor). Keys that are missing take the defaults of
transformers' Qwen2-VL image processor, which both families use; the token
ids come from config.json, with the defaults of transformers' configs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VisionSpec:
    """A model's image processor settings (its preprocessor_config.json, or
    the mmproj GGUF's metadata), and the token ids its prompts use."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int



# The families whose image processor is transformers' Qwen2VLImageProcessor.
VISION_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})

# transformers' Qwen2VLImageProcessor class defaults.
_DEFAULT_PATCH_SIZE = 14
_DEFAULT_MERGE_SIZE = 2
_DEFAULT_TEMPORAL_PATCH_SIZE = 2
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3

# transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL config defaults.
_DEFAULT_TOKEN_IDS = {"image_token_id": 151655, "vision_start_token_id": 151652,
                      "vision_end_token_id": 151653}


class VisionSpecError(ValueError):
    """The model directory does not describe an image processor we can follow."""


def read_vision_spec(model_dir: str | Path) -> VisionSpec:
    """The VisionSpec of the model in `model_dir`, or a VisionSpecError that
    says what is missing."""
    directory = Path(model_dir)
    config = _read_json(directory / "config.json")
    if config is None:
        raise VisionSpecError(f"{directory} has no config.json")
    processor = _image_processor_config(directory)
    return vision_spec_from_configs(processor, config, source=str(directory))


def vision_spec_from_configs(processor: dict[str, Any], config: dict[str, Any],
                             source: str = "the model") -> VisionSpec:
    """The VisionSpec of an image processor config and a model config."""
    model_type = config.get("model_type")
    if model_type not in VISION_MODEL_TYPES:
        raise VisionSpecError(f"{source} is a {model_type!r} model; images are supported for "
                              f"{', '.join(sorted(VISION_MODEL_TYPES))}")
    _refuse_other_pipelines(processor, source)
    size = processor.get("size") or {}
    # As transformers' processor: min_pixels/max_pixels (older configs) win
    # over size's shortest_edge/longest_edge (newer ones).
    min_pixels = _first(processor.get("min_pixels"), size.get("shortest_edge"),
                        _DEFAULT_MIN_PIXELS)
    max_pixels = _first(processor.get("max_pixels"), size.get("longest_edge"),
                        _DEFAULT_MAX_PIXELS)
    def setting(key: str, default: Any) -> Any:
        return _first(processor.get(key), default)

    spec = VisionSpec(
        patch_size=int(setting("patch_size", _DEFAULT_PATCH_SIZE)),
        merge_size=int(setting("merge_size", _DEFAULT_MERGE_SIZE)),
        temporal_patch_size=int(setting("temporal_patch_size", _DEFAULT_TEMPORAL_PATCH_SIZE)),
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        image_mean=_triple(setting("image_mean", _OPENAI_CLIP_MEAN), "image_mean", source),
        image_std=_triple(setting("image_std", _OPENAI_CLIP_STD), "image_std", source),
        **{name: int(_first(config.get(name), default))
           for name, default in _DEFAULT_TOKEN_IDS.items()},
    )
    if min(spec.patch_size, spec.merge_size, spec.temporal_patch_size) < 1:
        raise VisionSpecError(f"{source}: patch_size, merge_size and temporal_patch_size must "
                              "be positive")
    if not 0 < spec.min_pixels <= spec.max_pixels:
        raise VisionSpecError(f"{source}: min_pixels ({spec.min_pixels}) must be positive and "
                              f"at most max_pixels ({spec.max_pixels})")
    return spec


def _image_processor_config(directory: Path) -> dict[str, Any]:
    processor = _read_json(directory / "preprocessor_config.json")
    if processor is not None:
        return processor
    combined = _read_json(directory / "processor_config.json")
    if combined is not None and isinstance(combined.get("image_processor"), dict):
        return combined["image_processor"]
    raise VisionSpecError(f"{directory} has no image processor config (preprocessor_config.json, "
                          "or processor_config.json with an \"image_processor\" entry); a vision "
                          "model needs one")


def _refuse_other_pipelines(processor: dict[str, Any], source: str) -> None:
    """The loader and the tower implement transformers' default pipeline
    (bicubic resize, rescale by 1/255, normalise, RGB); a config that asks
    for another would silently get different pixels, so it is refused."""
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if processor.get(flag) not in (None, True):
            raise VisionSpecError(f"{source}: the image processor sets {flag} = false, "
                                  "which this server does not support")
    if processor.get("resample") not in (None, _BICUBIC):
        raise VisionSpecError(f"{source}: the image processor resamples with "
                              f"{processor['resample']!r}; only bicubic (3) is supported")
    if abs(float(processor.get("rescale_factor") or 1 / 255) - 1 / 255) > 1e-12:
        raise VisionSpecError(f"{source}: the image processor rescales by "
                              f"{processor['rescale_factor']!r}; only 1/255 is supported")


def _first(*values: Any) -> Any:
    """The first value that is not None: a key written as null reads as missing."""
    return next(value for value in values if value is not None)


def _triple(value: Any, name: str, source: str) -> tuple[float, float, float]:
    if isinstance(value, int | float):
        value = [value] * 3
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise VisionSpecError(f"{source}: {name} must be three numbers, got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise VisionSpecError(f"{path} cannot be read: {error}") from None
    if not isinstance(data, dict):
        raise VisionSpecError(f"{path} is not a JSON object")
    return data
