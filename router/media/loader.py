"""A request's ImageRefs to PreparedImages for one model: fetched, decoded,
resized and digested, all images at once, with the request's limits."""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from router.media.decode import decode_image
from router.media.errors import INVALID_IMAGE, TOO_MANY_IMAGE_TOKENS, TOO_MANY_IMAGES, MediaError
from router.media.fetch import ImageFetcher
from router.media.limits import MediaLimits
from router.media.resize import pixel_bounds, resize_to, smart_resize
from router.media.sources import read_image_bytes
from router.media.types import Detail, ImageRef, PreparedImage, VisionSpec

_executor: ThreadPoolExecutor | None = None


def decode_executor() -> ThreadPoolExecutor:
    """The threads that decode and resize images. Pillow and hashlib release
    the GIL on large buffers, so a few threads decode in parallel; a few and
    not one per image bounds the memory that decoding many images at once
    takes (a 64-megapixel image decodes to 256 MB of RGBA)."""
    global _executor
    if _executor is None:
        workers = max(1, min(4, os.cpu_count() or 1))
        _executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="media-decode")
    return _executor


async def prepare_images(refs: Sequence[ImageRef], spec: VisionSpec, limits: MediaLimits,
                         fetcher: ImageFetcher | None = None, *,
                         executor: Executor | None = None) -> list[PreparedImage]:
    """The PreparedImages of `refs`, in their order. Images load concurrently;
    the first failure cancels the rest and is raised as a MediaError naming
    its ref.param (of failures seen together, the earliest in `refs`).
    Without a fetcher, http(s) URLs are refused (only data URIs are read)."""
    if len(refs) > limits.max_images:
        raise MediaError(f"a request may carry at most {limits.max_images} images, this one has "
                         f"{len(refs)}", code=TOO_MANY_IMAGES, param=refs[limits.max_images].param)
    if not refs:
        return []
    pool = executor or decode_executor()
    tasks = [asyncio.ensure_future(_prepare_one(ref, spec, limits, fetcher, pool)) for ref in refs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    images = [task.result() for task in tasks]
    check_image_tokens(refs, images, limits)
    return images


def check_image_tokens(refs: Sequence[ImageRef], images: Sequence[PreparedImage],
                       limits: MediaLimits) -> None:
    """Refuse a request whose images together need more than
    limits.max_image_tokens vision tokens, naming the image that crosses it."""
    total = 0
    for ref, image in zip(refs, images, strict=True):
        total += image.num_tokens
        if total > limits.max_image_tokens:
            raise MediaError(f"the request's images need {sum(i.num_tokens for i in images)} "
                             f"vision tokens, over the limit of {limits.max_image_tokens}; send "
                             "fewer or smaller images, or detail \"low\"",
                             code=TOO_MANY_IMAGE_TOKENS, param=ref.param)


async def _prepare_one(ref: ImageRef, spec: VisionSpec, limits: MediaLimits,
                       fetcher: ImageFetcher | None, pool: Executor) -> PreparedImage:
    data = await read_image_bytes(ref, limits.max_image_bytes, fetcher)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, prepare_image, data, ref.param, ref.detail, spec,
                                      limits)


def prepare_image(data: bytes, param: str, detail: Detail, spec: VisionSpec,
                  limits: MediaLimits) -> PreparedImage:
    """One image's encoded bytes to its PreparedImage (synchronous, CPU-bound)."""
    image = decode_image(data, param, limits.max_image_pixels)
    min_pixels, max_pixels = pixel_bounds(spec, detail, limits.low_detail_max_tokens)
    try:
        height, width = smart_resize(image.height, image.width, spec.patch_size * spec.merge_size,
                                     min_pixels, max_pixels)
    except ValueError as error:
        raise MediaError(f"the image ({image.width}x{image.height}) cannot be used: {error}",
                         code=INVALID_IMAGE, param=param) from None
    rgb = resize_to(image, height, width).tobytes()
    grid_t, grid_h, grid_w = 1, height // spec.patch_size, width // spec.patch_size
    return PreparedImage(
        rgb=rgb, width=width, height=height, grid_t=grid_t, grid_h=grid_h, grid_w=grid_w,
        num_tokens=grid_t * grid_h * grid_w // (spec.merge_size * spec.merge_size),
        digest=image_digest(width, height, grid_t, grid_h, grid_w, rgb))


def image_digest(width: int, height: int, grid_t: int, grid_h: int, grid_w: int,
                 rgb: bytes) -> bytes:
    """sha256 over the size, the grid and the pixels: what the tower sees.
    The model is not in it; the prefix cache that keys by it is per model."""
    digest = hashlib.sha256(struct.pack("<5I", width, height, grid_t, grid_h, grid_w))
    digest.update(rgb)
    return digest.digest()
