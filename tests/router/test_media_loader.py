"""A request's images prepared for a model (router/media/loader.py)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web
from PIL import Image

from router.media.errors import MediaError
from router.media.fetch import ImageFetcher
from router.media.limits import MediaLimits
from router.media.loader import image_digest, prepare_images
from router.media.types import ImageRef, PreparedImage
from tests.router.media_images import QWEN25_SPEC, data_uri, encode, noise_image


def prepare(refs: list[ImageRef], limits: MediaLimits | None = None,
            fetcher: ImageFetcher | None = None, **options) -> list[PreparedImage]:
    return asyncio.run(prepare_images(refs, QWEN25_SPEC, limits or MediaLimits(), fetcher,
                                      **options))


def refused(refs: list[ImageRef], code: str, param: str, **options) -> MediaError:
    with pytest.raises(MediaError) as caught:
        prepare(refs, **options)
    assert caught.value.code == code, caught.value.message
    assert caught.value.param == param
    return caught.value


def ref(index: int, image_bytes: bytes, detail: str = "auto") -> ImageRef:
    return ImageRef(data_uri(image_bytes), f"messages[0].content[{index}].image_url", detail)


def test_images_come_back_in_order_with_their_grid() -> None:
    sizes = [(640, 480), (56, 56), (100, 300)]
    refs = [ref(i, encode(noise_image(w, h, seed=i))) for i, (w, h) in enumerate(sizes)]
    images = prepare(refs)
    assert [(image.width, image.height) for image in images] == [(504, 364), (56, 56), (112, 308)]
    for image in images:
        assert image.grid_t == 1
        assert (image.grid_h, image.grid_w) == (image.height // 14, image.width // 14)
        assert image.num_tokens == image.grid_h * image.grid_w // 4
        assert len(image.rgb) == image.width * image.height * 3
        expected = hashlib.sha256(
            image.width.to_bytes(4, "little") + image.height.to_bytes(4, "little")
            + (1).to_bytes(4, "little") + image.grid_h.to_bytes(4, "little")
            + image.grid_w.to_bytes(4, "little") + image.rgb).digest()
        assert image.digest == expected
    assert prepare([]) == []


def test_equal_images_have_equal_digests_and_different_ones_differ() -> None:
    png = encode(noise_image(200, 150, seed=1))
    same_pixels_as_webp = encode(noise_image(200, 150, seed=1), "WEBP", lossless=True)
    other = encode(noise_image(200, 150, seed=2))
    a, b, c, d = prepare([ref(0, png), ref(1, same_pixels_as_webp), ref(2, other),
                          ref(3, png, "low")], MediaLimits(low_detail_max_tokens=16))
    assert a.digest == b.digest
    assert a.digest != c.digest
    assert a.digest != d.digest  # the same picture at another size is other tower input
    # The grid is in the digest: the same bytes seen as another shape differ.
    assert image_digest(4, 2, 1, 2, 4, bytes(24)) != image_digest(2, 4, 1, 4, 2, bytes(24))


def test_too_many_images_names_the_first_one_over() -> None:
    png = encode(noise_image(30, 30))
    error = refused([ref(i, png) for i in range(4)], "too_many_images",
                    "messages[0].content[3].image_url", limits=MediaLimits(max_images=3))
    assert "at most 3" in error.message
    assert len(prepare([ref(i, png) for i in range(3)], MediaLimits(max_images=3))) == 3


def test_too_many_vision_tokens_names_the_image_that_crosses_the_limit() -> None:
    # 640x480 -> 234 tokens each at QWEN25_SPEC's max_pixels.
    png = encode(noise_image(640, 480))
    limits = MediaLimits(max_image_tokens=500, low_detail_max_tokens=64)
    error = refused([ref(0, png), ref(1, png), ref(2, png)], "too_many_image_tokens",
                    "messages[0].content[2].image_url", limits=limits)
    assert "702" in error.message and "500" in error.message
    assert len(prepare([ref(0, png), ref(1, png)], limits)) == 2
    # detail "low" is the way under it.
    low = [ref(i, png, "low") for i in range(3)]
    assert sum(image.num_tokens for image in prepare(low, limits)) <= 3 * 64


def test_the_failing_image_is_named() -> None:
    good = encode(Image.new("RGB", (30, 30), (10, 20, 30)))
    assert len(good) < 1000
    refs = [ref(0, good), ImageRef(data_uri(b"not an image"), "input[1].content[2]"), ref(2, good)]
    refused(refs, "unsupported_image_format", "input[1].content[2]")
    refs = [ref(0, good), ref(1, encode(Image.new("RGB", (3000, 3000))))]
    refused(refs, "image_too_large", "messages[0].content[1].image_url",
            limits=MediaLimits(max_image_pixels=4_000_000))
    refs = [ref(0, good), ref(1, b"x" * 2000)]
    refused(refs, "image_too_large", "messages[0].content[1].image_url",
            limits=MediaLimits(max_image_bytes=1000))
    refused([ref(0, encode(noise_image(1000, 4)))], "invalid_image",
            "messages[0].content[0].image_url")  # aspect ratio 250:1
    refused([ImageRef("https://example.com/a.png", "messages[0].content[0].image_url")],
            "image_url_refused", "messages[0].content[0].image_url")


def test_decoding_runs_off_the_event_loop() -> None:
    threads: set[str] = set()

    class Recording(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            def run():
                threads.add(threading.current_thread().name)
                return fn(*args, **kwargs)
            return super().submit(run)

    with Recording(max_workers=2, thread_name_prefix="decode-test") as pool:
        prepare([ref(0, encode(noise_image(64, 64))), ref(1, encode(noise_image(64, 64)))],
                executor=pool)
    assert threads and all(name.startswith("decode-test") for name in threads)


def test_data_uris_and_urls_load_together() -> None:
    png = encode(noise_image(120, 90, seed=5))

    async def main() -> None:
        async def image(request: web.Request) -> web.Response:
            return web.Response(body=png, content_type="image/png")

        app = web.Application()
        app.router.add_get("/a.png", image)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/a.png"
        try:
            async with ImageFetcher(allow_private_addresses=True) as fetcher:
                from_url, from_data = await prepare_images(
                    [ImageRef(url, "url"), ref(1, png)], QWEN25_SPEC, MediaLimits(), fetcher)
            assert from_url.digest == from_data.digest
        finally:
            await runner.cleanup()

    asyncio.run(main())
