"""An ImageRef's url to the image's encoded bytes: data: URIs decoded here,
http(s) URLs fetched by an ImageFetcher (router/media/fetch.py)."""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING
from urllib.parse import unquote

from router.media.errors import (
    IMAGE_TOO_LARGE,
    IMAGE_URL_REFUSED,
    INVALID_IMAGE_URL,
    UNSUPPORTED_IMAGE_FORMAT,
    MediaError,
)
from router.media.types import ImageRef

if TYPE_CHECKING:
    from router.media.fetch import ImageFetcher

# Declared types the bytes may be an image under. The bytes' own signature
# decides the format (router/media/decode.py), so these only turn away what
# says it is something else (text/html, application/json): a client that
# labels a PNG "image/jpeg", or sends no type at all, still gets through.
_GENERIC_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream"})


def may_be_image(media_type: str) -> bool:
    """Whether a declared media type (a data URI's or a Content-Type, with or
    without parameters) allows image bytes."""
    essence = media_type.split(";", 1)[0].strip().lower()
    return essence.startswith("image/") or essence in _GENERIC_TYPES


def data_uri_from_base64(data: str, media_type: str = "application/octet-stream") -> str:
    """A data URI for bare base64 (llama.cpp's multimodal_data, Anthropic's
    base64 source): the APIs that take base64 without a URI hand the loader
    an ImageRef like any other."""
    return f"data:{media_type};base64,{data}"


def decode_base64(data: str, param: str, max_bytes: int) -> bytes:
    """Base64 text to bytes, refusing more than max_bytes before decoding.

    Strict first (the common case costs one pass); then tolerant of what
    clients really send: line breaks, missing padding, the URL-safe alphabet.
    """
    # 4 characters carry 3 bytes; a few characters of slack for padding and
    # whitespace, the exact check follows the decode.
    if len(data) // 4 * 3 > max_bytes + 3 + len(data) // 64:
        raise _too_large(len(data) // 4 * 3, max_bytes, param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        cleaned = "".join(data.split()).translate(_URLSAFE_TO_STANDARD).rstrip("=")
        cleaned += "=" * (-len(cleaned) % 4)
        try:
            raw = base64.b64decode(cleaned, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the image's base64 data does not decode", code=INVALID_IMAGE_URL,
                             param=param) from None
    if len(raw) > max_bytes:
        raise _too_large(len(raw), max_bytes, param)
    return raw


_URLSAFE_TO_STANDARD = str.maketrans("-_", "+/")


def decode_data_uri(url: str, param: str, max_bytes: int) -> bytes:
    """`data:[<media type>][;param=value...];base64,<data>` to bytes."""
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise MediaError("a data URI needs a ',' before its data", code=INVALID_IMAGE_URL,
                         param=param)
    media_type, *attributes = header.split(";")
    if "base64" not in (attribute.strip().lower() for attribute in attributes):
        raise MediaError("an image data URI must be base64 encoded (data:image/png;base64,...)",
                         code=INVALID_IMAGE_URL, param=param)
    if not may_be_image(media_type):
        raise MediaError(f"the data URI's media type {media_type.strip()!r} is not an image type",
                         code=UNSUPPORTED_IMAGE_FORMAT, param=param)
    if "%" in payload:
        # Some clients percent-encode '+', '/' and '=' inside the URI.
        payload = unquote(payload)
    return decode_base64(payload, param, max_bytes)


def _too_large(size: int, max_bytes: int, param: str) -> MediaError:
    return MediaError(f"the image has {size} bytes, over the limit of {max_bytes}",
                      code=IMAGE_TOO_LARGE, param=param)


async def read_image_bytes(ref: ImageRef, max_bytes: int, fetcher: ImageFetcher | None) -> bytes:
    """The encoded bytes an ImageRef points at. URLs need a fetcher; without
    one (URL fetching turned off) they are refused."""
    scheme = ref.url[:8].lower()
    if scheme.startswith("data:"):
        return decode_data_uri(ref.url, ref.param, max_bytes)
    if scheme.startswith(("http://", "https://")):
        if fetcher is None:
            raise MediaError("this server does not fetch image URLs; send the image as a "
                             "base64 data URI", code=IMAGE_URL_REFUSED, param=ref.param)
        return await fetcher.fetch(ref.url, ref.param)
    raise MediaError("an image must be a data: URI (base64) or an http(s) URL",
                     code=INVALID_IMAGE_URL, param=ref.param)
