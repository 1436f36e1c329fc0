"""The model's view of an image: smart_resize and the bicubic resize equal
transformers' Qwen2-VL image processor (its PIL backend)."""

from __future__ import annotations

import io
import itertools
import random

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as transformers_smart_resize,
)

from router.media.limits import MediaLimits
from router.media.loader import prepare_image
from router.media.resize import pixel_bounds, smart_resize
from tests.router.media_images import QWEN25_SPEC, encode, noise_image

# (factor, min_pixels, max_pixels): Qwen2.5-VL's and Qwen3-VL's shipped
# settings, transformers' defaults, and small budgets like detail "low".
SETTINGS = [(28, 3136, 12845056), (32, 65536, 16777216), (28, 56 * 56, 28 * 28 * 1280),
            (28, 3136, 256 * 28 * 28), (32, 1024, 256 * 32 * 32), (28, 100_000, 200_000)]


def test_smart_resize_equals_transformers() -> None:
    rng = random.Random(21)
    sides = [1, 2, 13, 14, 27, 28, 29, 41, 55, 56, 57, 100, 223, 224, 448, 511, 512, 640, 999,
             1080, 1920, 3000, 4096, 8000]
    sizes = list(itertools.product(sides, sides))
    sizes += [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(3000)]
    checked = 0
    for (height, width), (factor, low, high) in itertools.product(sizes, SETTINGS):
        try:
            expected = transformers_smart_resize(height, width, factor, low, high)
        except ValueError:
            with pytest.raises(ValueError):
                smart_resize(height, width, factor, low, high)
            continue
        assert smart_resize(height, width, factor, low, high) == expected, (height, width, factor)
        checked += 1
    assert checked > 20_000


def reference_processor(max_pixels: int = QWEN25_SPEC.max_pixels) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=QWEN25_SPEC.min_pixels, max_pixels=max_pixels,
                                    patch_size=14, merge_size=2, temporal_patch_size=2)


@pytest.mark.parametrize("width, height, mode", [
    (640, 480, "RGB"),   # shrunk to max_pixels
    (123, 77, "RGB"),    # grown... and rounded
    (30, 20, "RGB"),     # grown to min_pixels
    (224, 224, "RGB"),   # already on the grid: pillow copies
    (300, 41, "RGBA"),   # transparency composited first
    (97, 203, "L"),
])
def test_resized_pixels_equal_transformers(width: int, height: int, mode: str) -> None:
    source = noise_image(width, height, mode, seed=width)
    data = encode(source, "PNG")
    prepared = prepare_image(data, "p", "auto", QWEN25_SPEC, MediaLimits())
    ours = Image.frombytes("RGB", (prepared.width, prepared.height), prepared.rgb)

    processor = reference_processor()
    expected = processor(images=Image.open(io.BytesIO(data)), return_tensors="np")
    assert expected["image_grid_thw"].tolist() == [[prepared.grid_t, prepared.grid_h,
                                                    prepared.grid_w]]
    # Our pixels, rescaled, normalised and cut into patches by transformers
    # itself, are its pixel_values to the bit: the resize is the same.
    from_ours = processor(images=ours, do_resize=False, return_tensors="np")
    assert np.array_equal(from_ours["pixel_values"], expected["pixel_values"])
    assert prepared.num_tokens == expected["pixel_values"].shape[0] // 4


def test_low_detail_caps_the_tokens() -> None:
    factor = 28
    assert pixel_bounds(QWEN25_SPEC, "high", 256) == (QWEN25_SPEC.min_pixels,
                                                      QWEN25_SPEC.max_pixels)
    assert pixel_bounds(QWEN25_SPEC, "auto", 256) == pixel_bounds(QWEN25_SPEC, "high", 256)
    assert pixel_bounds(QWEN25_SPEC, "low", 64) == (QWEN25_SPEC.min_pixels, 64 * factor * factor)
    # Never under the model's min_pixels, never over its max_pixels.
    assert pixel_bounds(QWEN25_SPEC, "low", 1) == (QWEN25_SPEC.min_pixels, QWEN25_SPEC.min_pixels)
    assert pixel_bounds(QWEN25_SPEC, "low", 10**6)[1] == QWEN25_SPEC.max_pixels

    data = encode(noise_image(640, 480), "PNG")
    high = prepare_image(data, "p", "high", QWEN25_SPEC, MediaLimits())
    low = prepare_image(data, "p", "low", QWEN25_SPEC, MediaLimits(low_detail_max_tokens=64))
    assert (high.height, high.width, high.num_tokens) == (364, 504, 234)
    assert (low.height, low.width, low.num_tokens) == (168, 252, 54)
    # Equal to transformers' processor given the low budget as its max_pixels.
    expected = reference_processor(64 * factor * factor)(images=Image.open(io.BytesIO(data)),
                                                          return_tensors="np")
    assert expected["image_grid_thw"].tolist() == [[1, low.grid_h, low.grid_w]]
