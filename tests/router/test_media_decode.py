"""Image bytes to upright RGB (router/media/decode.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from router.media.decode import decode_image, sniff_format
from router.media.errors import MediaError
from tests.router.media_images import encode, noise_image

PARAM = "messages[2].content[0]"
LIMIT = 10_000_000


def refused(data: bytes, code: str, max_pixels: int = LIMIT) -> MediaError:
    with pytest.raises(MediaError) as caught:
        decode_image(data, PARAM, max_pixels)
    assert caught.value.code == code, caught.value.message
    assert caught.value.param == PARAM
    return caught.value


@pytest.mark.parametrize("image_format, options", [
    ("PNG", {}), ("WEBP", {"lossless": True}), ("GIF", {}), ("BMP", {}), ("JPEG", {"quality": 95}),
])
def test_supported_formats_decode_to_rgb(image_format: str, options: dict) -> None:
    source = noise_image(37, 21)
    data = encode(source, image_format, **options)
    assert sniff_format(data) == image_format
    decoded = decode_image(data, PARAM, LIMIT)
    assert decoded.mode == "RGB" and decoded.size == (37, 21)
    if image_format in ("PNG", "WEBP", "BMP"):
        assert decoded.tobytes() == source.tobytes()


@pytest.mark.parametrize("data, named", [
    (encode(noise_image(8, 8), "TIFF"), "TIFF"),
    (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "SVG"),
    (b"<svg width='10' height='10'></svg>", "SVG"),
    (b"just some text, not an image", "not an image"),
    (b"", "not an image"),
    (encode(noise_image(8, 8), "ICO"), "ICO"),
])
def test_other_formats_are_refused_by_name(data: bytes, named: str) -> None:
    error = refused(data, "unsupported_image_format")
    assert named in error.message
    assert "PNG, JPEG, WebP, GIF or BMP" in error.message


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_corrupt_bytes_are_refused(image_format: str) -> None:
    data = encode(noise_image(64, 64), image_format)
    truncated = data[: len(data) // 2]
    refused(truncated, "invalid_image")
    garbled = data[:16] + bytes(len(data) - 16)
    refused(garbled, "invalid_image")


def test_the_pixel_limit_is_checked_before_decoding() -> None:
    # A 9000x9000 PNG of one colour is a few kB: a decompression bomb.
    data = encode(Image.new("1", (9_000, 9_000)), "PNG")
    assert len(data) < 100_000
    error = refused(data, "image_too_large", max_pixels=50_000_000)
    assert "9000x9000" in error.message
    assert decode_image(encode(noise_image(100, 50)), PARAM, 5000).size == (100, 50)
    refused(encode(noise_image(100, 51)), "image_too_large", max_pixels=5000)


def test_pillows_own_bomb_check_is_a_clean_error() -> None:
    # Past twice pillow's MAX_IMAGE_PIXELS it refuses on open, before our check.
    data = encode(Image.new("1", (15_000, 15_000)), "PNG")
    refused(data, "image_too_large", max_pixels=10**12)


def exif_jpeg(image: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", quality=100, subsampling=0, exif=exif.tobytes())


def test_exif_orientation_turns_the_image_upright() -> None:
    # A wide image, left half black and right half white, stored with
    # "rotate 90° clockwise to view" (orientation 6).
    stored = Image.new("L", (64, 32), 0)
    stored.paste(255, (32, 0, 64, 32))
    decoded = np.asarray(decode_image(exif_jpeg(stored.convert("RGB"), 6), PARAM, LIMIT))
    assert decoded.shape == (64, 32, 3)  # now tall: 64 rows of 32
    # Turned clockwise, the stored left half (black) is at the top.
    assert decoded[:28].mean() < 10 and decoded[36:].mean() > 245
    unturned = np.asarray(decode_image(exif_jpeg(stored.convert("RGB"), 1), PARAM, LIMIT))
    assert unturned.shape == (32, 64, 3)


def test_an_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (20, 10), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    data = buffer.getvalue()
    assert Image.open(io.BytesIO(data)).n_frames == 2
    decoded = decode_image(data, PARAM, LIMIT)
    assert decoded.getpixel((5, 5)) == (255, 0, 0)


def test_an_animated_webp_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (20, 10), colour) for colour in ((0, 255, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    decoded = decode_image(buffer.getvalue(), PARAM, LIMIT)
    assert decoded.getpixel((5, 5)) == (0, 255, 0)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L", "CMYK"])
def test_rgb_conversion_matches_transformers(mode: str) -> None:
    source = noise_image(30, 20, "RGBA", seed=3)
    if mode == "P":
        source = source.convert("RGB").quantize(16)
        source.info["transparency"] = 3  # one palette entry is transparent
        data = encode(source, "PNG", transparency=3)
    else:
        source = source.convert(mode)
        data = encode(source, "JPEG" if mode == "CMYK" else "PNG")
    reference = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    assert np.array_equal(np.asarray(decode_image(data, PARAM, LIMIT)), reference)


def test_transparency_is_composited_on_white() -> None:
    clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    clear.putpixel((0, 0), (255, 0, 0, 255))
    clear.putpixel((1, 0), (0, 0, 255, 128))
    decoded = decode_image(encode(clear, "PNG"), PARAM, LIMIT)
    assert decoded.getpixel((3, 3)) == (255, 255, 255)
    assert decoded.getpixel((0, 0)) == (255, 0, 0)
    assert decoded.getpixel((1, 0)) == (127, 127, 255)
