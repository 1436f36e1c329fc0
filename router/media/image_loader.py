"""The router's one image loader: the server's MediaLimits (the --media-*
flags) and its one ImageFetcher, shared by every request of the app and
closed with it (router/app.py)."""

from __future__ import annotations

from collections.abc import Sequence

from router.media.fetch import ImageFetcher
from router.media.limits import MediaLimits
from router.media.loader import prepare_images
from router.media.types import ImageRef, PreparedImage, VisionSpec


class ImageLoader:
    def __init__(self, limits: MediaLimits, *, allow_private_addresses: bool = False):
        self.limits = limits
        self.fetcher = ImageFetcher(limits, allow_private_addresses=allow_private_addresses)

    async def load(self, refs: Sequence[ImageRef], spec: VisionSpec) -> list[PreparedImage]:
        """The request's images for the model of `spec`, in order (MediaError
        naming the image's field when one cannot be used)."""
        return await prepare_images(refs, spec, self.limits, self.fetcher)

    async def close(self) -> None:
        await self.fetcher.close()
