"""The size a Qwen vision-language model sees an image at, and the resize
that gets it there, computed as transformers' Qwen2-VL image processor does
(its PIL backend, Qwen2VLImageProcessorPil) so that the engine's patches
equal transformers' pixel_values."""

from __future__ import annotations

import math

from PIL import Image

from router.media.types import Detail, VisionSpec

# Qwen's processors refuse images more than 200 times longer than wide.
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` (patch_size *
    merge_size), scaled if needed so that height * width lies in
    [min_pixels, max_pixels], keeping the aspect ratio as well as the
    rounding allows. Raises ValueError past MAX_ASPECT_RATIO.

    The arithmetic (Python's round-half-even, the order of the divisions)
    is transformers' own: a different rounding would change the patch grid.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"the image's aspect ratio is over {MAX_ASPECT_RATIO}:1")
    rounded_height = round(height / factor) * factor
    rounded_width = round(width / factor) * factor
    if rounded_height * rounded_width > max_pixels:
        shrink = math.sqrt((height * width) / max_pixels)
        rounded_height = max(factor, math.floor(height / shrink / factor) * factor)
        rounded_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif rounded_height * rounded_width < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        rounded_height = math.ceil(height * grow / factor) * factor
        rounded_width = math.ceil(width * grow / factor) * factor
    return rounded_height, rounded_width


def pixel_bounds(spec: VisionSpec, detail: Detail, low_detail_max_tokens: int) -> tuple[int, int]:
    """(min_pixels, max_pixels) for one image. "high" and "auto" use the
    model's own max_pixels; "low" caps the image at low_detail_max_tokens
    vision tokens' worth of pixels (each token covers factor² pixels), never
    below the model's min_pixels."""
    if detail != "low":
        return spec.min_pixels, spec.max_pixels
    factor = spec.patch_size * spec.merge_size
    low_max = max(spec.min_pixels, min(spec.max_pixels, low_detail_max_tokens * factor * factor))
    return spec.min_pixels, low_max


def resize_to(image: Image.Image, height: int, width: int) -> Image.Image:
    """Bicubic resize of the uint8 RGB image, as transformers' PIL backend
    does it: pillow's resize on the 8-bit image, no reducing_gap. Pillow
    copies when the size is already right, as it does there."""
    return image.resize((width, height), resample=Image.Resampling.BICUBIC)
