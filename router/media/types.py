"""The shapes images take between the APIs, the media loader and the engine.

An API handler turns each image part of a request into an ImageRef (where the
image is and which request field named it). The loader (router/media/loader.py)
fetches and decodes it and resizes it to the model's patch grid, giving a
PreparedImage: the RGB pixels the engine's vision tower normalises and cuts
into patches, and the number of placeholder tokens the prompt carries for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.vision import VisionSpec

__all__ = ["Detail", "ImageRef", "PreparedImage", "VisionSpec"]

Detail = Literal["auto", "low", "high"]


@dataclass(frozen=True)
class ImageRef:
    """One image a request names, before anything is fetched or decoded.

    url: a data: URI (base64) or an http(s) URL.
    param: the request field that named it ("messages[1].content[0].image_url"),
    so an error about this image points at it.
    """

    url: str
    param: str
    detail: Detail = "auto"


@dataclass(frozen=True)
class PreparedImage:
    """An image decoded, oriented and resized for one model.

    rgb: height * width * 3 bytes, row-major, uint8 (what pillow gives).
    grid_t, grid_h, grid_w: the tower's patch grid (grid_t = 1 for a still
    image); num_tokens = grid_t * grid_h * grid_w // merge_size**2 is how
    many placeholder tokens stand for it in the prompt.
    digest: sha256 over the pixels and the grid: equal digests mean equal
    tower input, so the prefix cache keys the image's tokens by it.
    """

    rgb: bytes
    width: int
    height: int
    grid_t: int
    grid_h: int
    grid_w: int
    num_tokens: int
    digest: bytes
