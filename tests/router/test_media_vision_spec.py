"""A model directory's VisionSpec (protocol/vision.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from protocol.vision import VisionSpecError, read_vision_spec

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)


def model_dir(tmp_path: Path, config: dict, processor: dict | None,
              name: str = "preprocessor_config.json") -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if processor is not None:
        (tmp_path / name).write_text(json.dumps(processor))
    return tmp_path


def test_qwen2_5_vl_as_the_hub_ships_it(tmp_path: Path) -> None:
    processor = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": list(CLIP_MEAN),
                 "image_std": [0.26862954, 0.26130258, 0.27577711],
                 "image_processor_type": "Qwen2VLImageProcessor"}
    config = {"model_type": "qwen2_5_vl", "image_token_id": 151655,
              "vision_start_token_id": 151652, "vision_end_token_id": 151653}
    spec = read_vision_spec(model_dir(tmp_path, config, processor))
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (14, 2, 2)
    assert (spec.min_pixels, spec.max_pixels) == (3136, 12845056)
    assert spec.image_mean == CLIP_MEAN
    assert (spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id) == (
        151655, 151652, 151653)


def test_qwen3_vl_with_a_size_dict(tmp_path: Path) -> None:
    processor = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5]}
    config = {"model_type": "qwen3_vl", "image_token_id": 7, "vision_start_token_id": 8,
              "vision_end_token_id": 9, "text_config": {}}
    spec = read_vision_spec(model_dir(tmp_path, config, processor))
    assert (spec.patch_size, spec.min_pixels, spec.max_pixels) == (16, 65536, 16777216)
    assert spec.image_std == (0.5, 0.5, 0.5)
    assert (spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id) == (7, 8, 9)


def test_missing_keys_take_transformers_defaults(tmp_path: Path) -> None:
    spec = read_vision_spec(model_dir(tmp_path, {"model_type": "qwen2_5_vl"}, {}))
    reference = Qwen2VLImageProcessorPil()
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (
        reference.patch_size, reference.merge_size, reference.temporal_patch_size)
    assert (spec.min_pixels, spec.max_pixels) == (reference.size["shortest_edge"],
                                                  reference.size["longest_edge"])
    assert spec.image_mean == tuple(reference.image_mean)
    assert spec.image_std == tuple(reference.image_std)
    assert (spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id) == (
        151655, 151652, 151653)


def test_min_and_max_pixels_win_over_size_as_in_transformers(tmp_path: Path) -> None:
    processor = {"size": {"longest_edge": 1_000_000, "shortest_edge": 1000},
                 "min_pixels": 2000, "max_pixels": 500_000}
    spec = read_vision_spec(model_dir(tmp_path, {"model_type": "qwen2_vl"}, processor))
    reference = Qwen2VLImageProcessorPil(**processor)
    assert (spec.min_pixels, spec.max_pixels) == (reference.size["shortest_edge"],
                                                  reference.size["longest_edge"]) == (2000, 500_000)


def test_a_processor_saved_by_transformers_reads_back(tmp_path: Path) -> None:
    Qwen2VLImageProcessorPil(min_pixels=1234, max_pixels=56789, patch_size=16).save_pretrained(
        tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    spec = read_vision_spec(tmp_path)
    assert (spec.patch_size, spec.min_pixels, spec.max_pixels) == (16, 1234, 56789)


def test_a_combined_processor_config_is_read(tmp_path: Path) -> None:
    combined = {"image_processor": {"patch_size": 16, "size": {"shortest_edge": 10,
                                                               "longest_edge": 20}}}
    spec = read_vision_spec(model_dir(tmp_path, {"model_type": "qwen3_vl"}, combined,
                                      "processor_config.json"))
    assert (spec.patch_size, spec.min_pixels, spec.max_pixels) == (16, 10, 20)


def test_a_directory_without_an_image_processor_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VisionSpecError, match="no image processor config"):
        read_vision_spec(model_dir(tmp_path, {"model_type": "qwen2_5_vl"}, None))
    (tmp_path / "processor_config.json").write_text(json.dumps({"chat_template": "x"}))
    with pytest.raises(VisionSpecError, match="no image processor config"):
        read_vision_spec(tmp_path)


@pytest.mark.parametrize("config, processor, message", [
    ({"model_type": "qwen3"}, {}, "images are supported for"),
    ({"model_type": "qwen2_5_vl"}, {"resample": 2}, "only bicubic"),
    ({"model_type": "qwen2_5_vl"}, {"do_normalize": False}, "do_normalize"),
    ({"model_type": "qwen2_5_vl"}, {"rescale_factor": 1.0}, "1/255"),
    ({"model_type": "qwen2_5_vl"}, {"min_pixels": 10, "max_pixels": 5}, "at most max_pixels"),
    ({"model_type": "qwen2_5_vl"}, {"image_mean": [0.5, 0.5]}, "three numbers"),
])
def test_settings_we_cannot_follow_are_refused(tmp_path: Path, config: dict, processor: dict,
                                               message: str) -> None:
    with pytest.raises(VisionSpecError, match=message):
        read_vision_spec(model_dir(tmp_path, config, processor))


def test_no_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VisionSpecError, match=r"no config\.json"):
        read_vision_spec(tmp_path)
