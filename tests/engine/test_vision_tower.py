"""The vision towers (engine/models/vision/) against transformers: the
processor's pixel_values bit for bit from the same pillow images, and the
towers' outputs, loaded from the checkpoint transformers saves for small
random Qwen2.5-VL and Qwen3-VL configs, for one image and for several of
different (non-square, partially windowed) grids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from engine.models.vision import build_vision_tower
from engine.models.vision.grid import window_order
from engine.models.vision.patches import pixel_patches
from engine.models.vision.qwen2_5_vl import Qwen25VisionTower
from engine.models.vision.qwen3_vl import Qwen3VisionTower
from engine.models.vision.weights import load_vision_weights
from router.media.types import VisionSpec

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1)
# Grids (patches) of the compared images: square, non-square both ways, and
# with a 2-token window (Qwen2.5-VL below) grids whose windows are partial.
GRIDS = [(8, 8), (6, 10), (4, 12), (10, 6)]


def _spec(patch: int, mean: tuple[float, ...], std: tuple[float, ...]) -> VisionSpec:
    return VisionSpec(patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=0,
                      max_pixels=1 << 30, image_mean=mean, image_std=std,  # type: ignore[arg-type]
                      image_token_id=0, vision_start_token_id=0, vision_end_token_id=0)


def _images(grids: list[tuple[int, int]], patch: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h * patch, w * patch, 3), dtype=np.uint8))
            for h, w in grids]


def _processor(spec: VisionSpec) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=spec.patch_size, merge_size=spec.merge_size,
                                    temporal_patch_size=spec.temporal_patch_size,
                                    image_mean=list(spec.image_mean),
                                    image_std=list(spec.image_std))


def _our_patches(images: list[Image.Image], spec: VisionSpec) -> torch.Tensor:
    return torch.cat([
        pixel_patches(image.tobytes(), 1, image.height // spec.patch_size,
                      image.width // spec.patch_size, spec, torch.float32, "cpu")
        for image in images])


@pytest.mark.parametrize("spec", [_spec(14, CLIP_MEAN, CLIP_STD), _spec(16, HALF, HALF)],
                         ids=["qwen2.5-vl", "qwen3-vl"])
def test_pixel_patches_equal_the_processors_pixel_values(spec: VisionSpec) -> None:
    images = _images(GRIDS, spec.patch_size, seed=spec.patch_size)
    # The router resized already; the processor's resize would be the identity.
    expected = _processor(spec)(images=images, do_resize=False, return_tensors="pt")
    ours = _our_patches(images, spec)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, expected["pixel_values"])
    assert expected["image_grid_thw"].tolist() == [[1, h, w] for h, w in GRIDS]


def test_pixel_patches_refuse_rgb_of_another_size() -> None:
    spec = _spec(14, CLIP_MEAN, CLIP_STD)
    with pytest.raises(ValueError, match="bytes of RGB"):
        pixel_patches(bytes(28 * 28 * 3 - 1), 1, 2, 2, spec, torch.float32, "cpu")


@pytest.mark.parametrize("grids", [[(1, 8, 8), (1, 6, 10)], [(2, 4, 12), (1, 10, 6)],
                                   [(1, 2, 2)]])
@pytest.mark.parametrize("window_tokens", [1, 2, 3])
def test_window_order_is_transformers(grids: list[tuple[int, int, int]],
                                      window_tokens: int) -> None:
    from transformers.vision_utils import get_vision_window_index

    index, cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2,
                                        window_size=window_tokens * 2 * 14, patch_size=14)
    order, lengths = window_order(grids, 2, window_tokens)
    assert torch.equal(order, index)
    assert [0, *np.cumsum(lengths).tolist()] == cu.tolist()


def _saved(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    # window 56 px = 2 merged tokens a side: 8 x 8 patches make 4 whole
    # windows, 6 x 10 a row and a column of partial ones.
    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=dict(
        depth=4, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=64,
        fullatt_block_indexes=[1, 3], window_size=56))
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    return model, _saved(model, tmp_path_factory.mktemp("qwen2.5-vl"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    # An 8 x 8 position table, resampled up and down to the grids.
    config = Qwen3VLConfig(text_config={**TEXT, "head_dim": 32}, vision_config=dict(
        depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=64,
        deepstack_visual_indexes=[0, 2], num_position_embeddings=64))
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    return model, _saved(model, tmp_path_factory.mktemp("qwen3-vl"))


def _our_tower(model: Any, path: Path) -> Qwen25VisionTower | Qwen3VisionTower:
    tower = build_vision_tower(model.config.to_dict(), "cpu", torch.float32)
    load_vision_weights(tower, _checkpoint_tensors(path))
    return tower


def _assert_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape
    scale = expected.abs().max().item()
    error = (ours - expected).abs().max().item()
    assert error <= 1e-5 * scale, f"max abs error {error:.3g} at output scale {scale:.3g}"


def _both(model: Any, tower: Any, grids: list[tuple[int, int]], spec: VisionSpec
          ) -> tuple[Any, tuple[torch.Tensor, list[torch.Tensor]]]:
    images = _images(grids, spec.patch_size, seed=len(grids))
    inputs = _processor(spec)(images=images, do_resize=False, return_tensors="pt")
    with torch.no_grad():
        expected = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        ours = tower(_our_patches(images, spec), [(1, h, w) for h, w in grids])
    return expected, ours


CASES = [GRIDS[:1], GRIDS[1:2], GRIDS]


@pytest.mark.parametrize("grids", CASES, ids=["square", "partial-windows", "four-images"])
def test_qwen2_5_vl_tower_equals_transformers(qwen25: tuple[Any, Path],
                                              grids: list[tuple[int, int]]) -> None:
    model, path = qwen25
    tower = _our_tower(model, path)
    assert isinstance(tower, Qwen25VisionTower)
    expected, (embeddings, deepstack) = _both(model, tower, grids, _spec(14, CLIP_MEAN, CLIP_STD))
    assert embeddings.shape == (sum(h * w for h, w in grids) // 4, 64)
    _assert_close(embeddings, expected.pooler_output)
    assert deepstack == []


@pytest.mark.parametrize("grids", CASES, ids=["square", "non-square", "four-images"])
def test_qwen3_vl_tower_equals_transformers(qwen3: tuple[Any, Path],
                                            grids: list[tuple[int, int]]) -> None:
    model, path = qwen3
    tower = _our_tower(model, path)
    assert isinstance(tower, Qwen3VisionTower)
    expected, (embeddings, deepstack) = _both(model, tower, grids, _spec(16, HALF, HALF))
    _assert_close(embeddings, expected.pooler_output)
    assert len(deepstack) == len(expected.deepstack_features) == 2
    for ours, theirs in zip(deepstack, expected.deepstack_features, strict=True):
        _assert_close(ours, theirs)


def test_windowed_layers_matter(qwen25: tuple[Any, Path]) -> None:
    """The comparison above can fail: with every layer attending over the
    whole image the output differs from transformers' beyond the tolerance."""
    model, path = qwen25
    tower = _our_tower(model, path)
    tower.config = type(tower.config)(**{**tower.config.__dict__,
                                         "fullatt_block_indexes": (0, 1, 2, 3)})
    expected, (embeddings, _) = _both(model, tower, GRIDS[1:2], _spec(14, CLIP_MEAN, CLIP_STD))
    with pytest.raises(AssertionError, match="max abs error"):
        _assert_close(embeddings, expected.pooler_output)


def test_loading_refuses_a_checkpoint_that_does_not_match(qwen3: tuple[Any, Path]) -> None:
    model, path = qwen3
    tower = build_vision_tower(model.config.to_dict(), "cpu", torch.float32)
    tensors = dict(_checkpoint_tensors(path))
    del tensors["model.visual.deepstack_merger_list.1.norm.bias"]
    with pytest.raises(ValueError, match="lacks 1 vision tensors"):
        load_vision_weights(tower, tensors.items())
    tensors["model.visual.pos_embed.weight"] = torch.zeros(81, 64)
    with pytest.raises(ValueError, match="has shape"):
        load_vision_weights(tower, tensors.items())


def test_build_refuses_a_model_type_without_a_tower() -> None:
    with pytest.raises(ValueError, match="no vision tower for model_type 'qwen3'"):
        build_vision_tower({"model_type": "qwen3"}, "cpu", torch.float32)


def _relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return ((ours.float().cpu() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_gpu_towers_match_the_cpu_reference(family: str,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """On the GPU (torch SDPA per group of equal-length segments): float32
    equals the CPU's exact math, and bfloat16 is no further from transformers'
    float32 than transformers' own bfloat16 run is (twice its error at most),
    at the real towers' head sizes (80 and 72) with a 448 x 448 and a
    non-square image."""
    import transformers

    qwen25 = family == "qwen2.5-vl"
    patch = 14 if qwen25 else 16
    vision: dict[str, Any] = dict(depth=4, intermediate_size=512, num_heads=4,
                                  out_hidden_size=256)
    if qwen25:
        vision.update(hidden_size=320, fullatt_block_indexes=[1, 3], window_size=112)
        config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision)
        model_class: Any = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(hidden_size=288, deepstack_visual_indexes=[1, 2],
                      num_position_embeddings=576)
        config = transformers.Qwen3VLConfig(text_config={**TEXT, "head_dim": 32},
                                            vision_config=vision)
        model_class = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    model = model_class(config).eval()
    path = _saved(model, tmp_path_factory.mktemp(family))
    spec = _spec(patch, CLIP_MEAN, CLIP_STD) if qwen25 else _spec(patch, HALF, HALF)
    side = 448 // patch // 2 * 2
    grids = [(side, side), (12, 24)]
    images = _images(grids, patch, seed=7)
    inputs = _processor(spec)(images=images, do_resize=False, return_tensors="pt")
    thw = [(1, h, w) for h, w in grids]

    def outputs(result: Any) -> list[torch.Tensor]:
        if isinstance(result, tuple):
            return [result[0], *result[1]]
        return [result.pooler_output, *getattr(result, "deepstack_features", [])]

    with torch.no_grad():
        expected = outputs(model.model.visual(inputs["pixel_values"],
                                              grid_thw=inputs["image_grid_thw"]))
        rough = model.to("cuda", torch.bfloat16).model.visual
        theirs_bf16 = outputs(rough(inputs["pixel_values"].to("cuda", torch.bfloat16),
                                    grid_thw=inputs["image_grid_thw"].to("cuda")))
        for dtype in (torch.float32, torch.bfloat16):
            tower = build_vision_tower(config.to_dict(), "cuda", dtype)
            load_vision_weights(tower, _checkpoint_tensors(path))
            patches = torch.cat([pixel_patches(image.tobytes(), 1, h, w, spec, dtype, "cuda")
                                 for image, (_, h, w) in zip(images, thw, strict=True)])
            ours = outputs(tower(patches, thw))
            assert len(ours) == len(expected)
            for mine, exact, theirs in zip(ours, expected, theirs_bf16, strict=True):
                error = _relative_error(mine, exact)
                if dtype == torch.float32:
                    assert error <= 1e-4, error
                else:
                    assert error <= 2 * _relative_error(theirs, exact), (
                        error, _relative_error(theirs, exact))


def test_config_reads_a_released_qwen2_5_vl_vision_config() -> None:
    """Qwen2.5-VL-7B-Instruct's vision_config: in_chans, no rope parameters."""
    from engine.models.vision import VisionTowerConfig

    config = VisionTowerConfig.from_hf({
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
        "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2})
    assert (config.in_channels, config.rope_theta, config.head_dim) == (3, 10000.0, 80)
    assert config.patch_dim == 3 * 2 * 14 * 14
    assert config.fullatt_block_indexes == (7, 15, 23, 31)
