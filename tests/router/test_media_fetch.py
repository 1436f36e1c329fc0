"""Image URLs fetched with limits and the SSRF guard (router/media/fetch.py),
against a real aiohttp server on a loopback address."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from router.media.errors import MediaError
from router.media.fetch import ImageFetcher, IpAddress, is_public_address
from router.media.limits import MediaLimits

PARAM = "messages[0].content[0].image_url"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
# The test server listens here; TrustingFetcher treats it as public so that
# the default policy still applies to everything else (127.0.0.1 above all).
SERVER_HOST = "127.0.0.2"


class TrustingFetcher(ImageFetcher):
    def address_allowed(self, ip: IpAddress) -> bool:
        return str(ip) == SERVER_HOST or super().address_allowed(ip)


def routes(sent: dict[str, int]) -> web.Application:
    async def image(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html></html>", content_type="text/html")

    async def untyped(request: web.Request) -> web.Response:
        response = web.Response(body=PNG)
        response.headers["Content-Type"] = "application/octet-stream"
        return response

    async def endless(request: web.Request) -> web.StreamResponse:
        # No Content-Length: the limit can only be found while streaming.
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        try:
            for _ in range(10_000):
                await response.write(b"\0" * 16384)
                sent["endless"] = sent.get("endless", 0) + 16384
                await asyncio.sleep(0.001)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return response

    async def declared_large(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.content_length = 30 * 1024 * 1024  # over the default 20 MiB
        await response.prepare(request)
        await response.write(b"\x89PNG")  # aiohttp sends the headers with the first bytes
        await asyncio.sleep(5)
        return response

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(body=PNG, content_type="image/png")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    async def loop(request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    async def missing(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/image.png", image)
    app.router.add_get("/page", html)
    app.router.add_get("/untyped", untyped)
    app.router.add_get("/endless", endless)
    app.router.add_get("/declared-large", declared_large)
    app.router.add_get("/slow", slow)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/loop", loop)
    app.router.add_get("/missing", missing)
    return app


def serve(test: Callable[[str, dict[str, int]], Awaitable[None]]) -> dict[str, int]:
    """Run `test(base_url, sent)` against the server; return what it sent."""
    sent: dict[str, int] = {}

    async def main() -> None:
        runner = web.AppRunner(routes(sent), shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, SERVER_HOST, 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            await test(f"http://{SERVER_HOST}:{port}", sent)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return sent


async def refusal(fetcher: ImageFetcher, url: str, code: str) -> MediaError:
    async with fetcher:
        with pytest.raises(MediaError) as caught:
            await fetcher.fetch(url, PARAM)
    assert caught.value.code == code, caught.value.message
    assert caught.value.param == PARAM
    return caught.value


def test_an_image_url_is_fetched() -> None:
    async def test(base: str, sent: dict[str, int]) -> None:
        async with TrustingFetcher() as fetcher:
            assert await fetcher.fetch(f"{base}/image.png", PARAM) == PNG
            assert await fetcher.fetch(f"{base}/untyped", PARAM) == PNG
            # Relative and absolute redirects to an allowed host are followed.
            assert await fetcher.fetch(f"{base}/redirect?to=/image.png", PARAM) == PNG
            assert await fetcher.fetch(f"{base}/redirect?to={base}/image.png", PARAM) == PNG

    serve(test)


def test_private_addresses_are_refused_unless_allowed() -> None:
    async def test(base: str, sent: dict[str, int]) -> None:
        error = await refusal(ImageFetcher(), f"{base}/image.png", "image_url_refused")
        assert "public" in error.message
        # A name is checked by the addresses it resolves to.
        port = base.rsplit(":", 1)[1]
        await refusal(ImageFetcher(), f"http://localhost:{port}/image.png", "image_url_refused")
        async with ImageFetcher(allow_private_addresses=True) as fetcher:
            assert await fetcher.fetch(f"{base}/image.png", PARAM) == PNG

    serve(test)


def test_a_redirect_to_a_private_address_is_refused() -> None:
    async def test(base: str, sent: dict[str, int]) -> None:
        port = base.rsplit(":", 1)[1]
        for target in (f"http://127.0.0.1:{port}/image.png", f"http://localhost:{port}/image.png",
                       "http://169.254.169.254/latest/meta-data/", "http://[::1]/",
                       "http://10.0.0.1/"):
            await refusal(TrustingFetcher(), f"{base}/redirect?to={target}", "image_url_refused")
        await refusal(TrustingFetcher(), f"{base}/redirect?to=file:///etc/passwd",
                      "invalid_image_url")
        # The same redirect is followed where private addresses are allowed.
        async with ImageFetcher(allow_private_addresses=True) as fetcher:
            target = f"http://127.0.0.1:{port}/image.png"
            with pytest.raises(MediaError) as caught:
                await fetcher.fetch(f"{base}/redirect?to={target}", PARAM)
            assert caught.value.code == "image_fetch_failed"  # nothing listens on 127.0.0.1

    serve(test)


def test_redirects_are_bounded() -> None:
    async def test(base: str, sent: dict[str, int]) -> None:
        error = await refusal(TrustingFetcher(MediaLimits(max_redirects=3)), f"{base}/loop",
                              "image_fetch_failed")
        assert "more than 3" in error.message

    serve(test)


def test_a_slow_url_times_out() -> None:
    async def test(base: str, sent: dict[str, int]) -> None:
        started = asyncio.get_running_loop().time()
        error = await refusal(TrustingFetcher(MediaLimits(fetch_timeout_s=0.3)), f"{base}/slow",
                              "image_fetch_timeout")
        assert asyncio.get_running_loop().time() - started < 2
        assert "0.3 s" in error.message

    serve(test)


def test_the_byte_limit_stops_the_download_midway() -> None:
    limits = MediaLimits(max_image_bytes=200_000)

    async def test(base: str, sent: dict[str, int]) -> None:
        await refusal(TrustingFetcher(limits), f"{base}/endless", "image_too_large")
        await asyncio.sleep(0.2)  # let the server notice the closed connection

    sent = serve(test)
    # The server got to write little more than the limit (plus what the
    # socket buffers held) of its 160 MB before the fetcher hung up.
    assert 200_000 < sent["endless"] < 20_000_000


def test_a_declared_length_over_the_limit_is_refused_before_the_body() -> None:
    async def test(base: str, sent: dict[str, int]) -> None:
        started = asyncio.get_running_loop().time()
        await refusal(TrustingFetcher(), f"{base}/declared-large", "image_too_large")
        assert asyncio.get_running_loop().time() - started < 2

    serve(test)


def test_non_image_answers_are_refused() -> None:
    async def test(base: str, sent: dict[str, int]) -> None:
        error = await refusal(TrustingFetcher(), f"{base}/page", "unsupported_image_format")
        assert "text/html" in error.message
        error = await refusal(TrustingFetcher(), f"{base}/missing", "image_fetch_failed")
        assert "404" in error.message

    serve(test)


def test_malformed_urls_are_refused() -> None:
    async def main() -> None:
        await refusal(ImageFetcher(), "http:///nohost", "invalid_image_url")

    asyncio.run(main())


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("93.184.216.34", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("239.255.255.250", False), ("240.0.0.1", False), ("255.255.255.255", False),
    ("192.0.2.1", False), ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False),
    ("ff02::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("2002:7f00:1::", False), ("64:ff9b::a00:1", False),
])
def test_which_addresses_are_public(address: str, public: bool) -> None:
    assert is_public_address(ipaddress.ip_address(address)) is public
