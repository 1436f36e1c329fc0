"""How much media one request may bring, and how long the router waits for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on the images of one request; the defaults suit a public server.

    max_image_bytes: the encoded size of one image, from a data URI or a URL
      (20 MiB, OpenAI's per-image limit).
    fetch_timeout_s: the whole fetch of one URL, redirects included.
    max_redirects: redirects followed per URL; each hop's address is checked.
    max_images: images in one request.
    max_image_pixels: width * height of one image as encoded, checked from its
      header before the pixels are decoded: Anthropic's 8000 px side, squared.
    max_image_tokens: vision tokens of all images of one request together.
    low_detail_max_tokens: the vision-token budget of a `detail: "low"` image
      (docs/vision.md says why 256).
    """

    max_image_bytes: int = 20 * 1024 * 1024
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    max_images: int = 16
    max_image_pixels: int = 8000 * 8000
    max_image_tokens: int = 32768
    low_detail_max_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_images", "max_image_pixels", "max_image_tokens",
                     "low_detail_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaLimits.{name} must be at least 1")
        if self.fetch_timeout_s <= 0:
            raise ValueError("MediaLimits.fetch_timeout_s must be positive")
        if self.max_redirects < 0:
            raise ValueError("MediaLimits.max_redirects must not be negative")
