"""Images drawn with pillow for the media loader's tests."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from router.media.types import VisionSpec

# Qwen2.5-VL's processor settings, with a small max_pixels so tests stay fast.
QWEN25_SPEC = VisionSpec(
    patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
    max_pixels=28 * 28 * 256, image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711), image_token_id=151655,
    vision_start_token_id=151652, vision_end_token_id=151653)


def noise_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels over a gradient: a resize that differs anywhere shows."""
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, bands))
    pixels = (ramp * 0.5 + rng.integers(0, 128, (height, width, bands))).astype(np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if bands == 1 else pixels, mode)


def encode(image: Image.Image, image_format: str = "PNG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"
