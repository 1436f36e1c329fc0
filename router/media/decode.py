"""Encoded image bytes to an upright RGB pillow image, refusing what is not
a supported image or is too large to decode. Synchronous and CPU-bound: the
loader runs it on a worker thread, never on the event loop."""

from __future__ import annotations

import io

from PIL import Image, ImageOps

from router.media.errors import (
    IMAGE_TOO_LARGE,
    INVALID_IMAGE,
    UNSUPPORTED_IMAGE_FORMAT,
    MediaError,
)

# The formats we decode, by their signature (the first bytes of the file);
# the declared media type never decides.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

# Formats clients do send that we do not decode, named in the error so the
# user knows what to convert from.
_OTHER_SIGNATURES = (
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"), (b"%PDF", "PDF"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
)


def sniff_format(data: bytes) -> str | None:
    """The supported format `data` starts like, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data.startswith(b"BM"):
        return "BMP"
    return None


def _describe_unsupported(data: bytes) -> str:
    for signature, name in _OTHER_SIGNATURES:
        if data.startswith(signature):
            return name
    if data[4:8] == b"ftyp":
        return "HEIF/AVIF"
    head = data[:256].lstrip().lower()
    if head.startswith((b"<svg", b"<?xml")) or b"<svg" in head:
        return "SVG"
    return "not an image"


def decode_image(data: bytes, param: str, max_pixels: int) -> Image.Image:
    """Decode, take the first frame of an animation, turn upright by the EXIF
    orientation, and convert to RGB (transparency composited on white).

    The pixel limit is checked from the header, before the pixels are
    decoded; pillow's own decompression-bomb check stays on as a backstop.
    """
    image_format = sniff_format(data)
    if image_format is None:
        raise MediaError(f"unsupported image format ({_describe_unsupported(data)}); send "
                         f"PNG, JPEG, WebP, GIF or BMP", code=UNSUPPORTED_IMAGE_FORMAT, param=param)
    try:
        image = Image.open(io.BytesIO(data), formats=[image_format])
        width, height = image.size
        if width * height > max_pixels:
            raise MediaError(f"the image is {width}x{height} pixels, over the limit of "
                             f"{max_pixels} pixels", code=IMAGE_TOO_LARGE, param=param)
        # Opening leaves an animation (GIF, animated WebP) on its first frame;
        # loading decodes just that frame.
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
        return to_rgb(image)
    except MediaError:
        raise
    except Image.DecompressionBombError:
        raise MediaError("the image has too many pixels to decode", code=IMAGE_TOO_LARGE,
                         param=param) from None
    except MemoryError:
        raise
    except Exception as error:
        # Decoders raise OSError, SyntaxError, ValueError, EOFError, struct
        # errors... on bytes that lie about themselves: all mean the same to
        # the client.
        raise MediaError(f"the {image_format} image could not be decoded: {error}",
                         code=INVALID_IMAGE, param=param) from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' image processors make it (image_transforms.
    convert_to_rgb): an image with an alpha band or a transparent palette
    entry is composited onto opaque white, anything else converted directly."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
