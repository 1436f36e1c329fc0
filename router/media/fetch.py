"""Fetching image URLs for requests, without letting a request reach inside
the network the router runs in (SSRF).

The guard, hop by hop (docs/vision.md repeats it for operators):
- only http and https, on every hop;
- redirects are followed here, not by aiohttp, at most MediaLimits.max_redirects;
- every hop's host must be a public address: an IP literal is checked before
  connecting, a name is checked by the resolver the connection itself uses,
  so the address checked is the address connected to (no DNS rebinding
  between a check and the connect). A name with any non-public address is
  refused as a whole;
- non-public means private, loopback, link-local, multicast, reserved,
  unspecified or otherwise not global (100.64/10, documentation ranges), and
  IPv6 forms that embed such an IPv4 address (::ffff:a.b.c.d, 6to4, NAT64);
- no proxy from the environment (it would connect on our behalf, unchecked),
  no cookies kept between fetches.
`allow_private_addresses=True` turns the address check off, for a server on
a private network whose images live beside it (and for our tests).

One limit covers the whole fetch, redirects included, and the byte limit is
enforced as the body streams in: a large body is cut off, not downloaded.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from router.media.errors import (
    IMAGE_FETCH_FAILED,
    IMAGE_FETCH_TIMEOUT,
    IMAGE_TOO_LARGE,
    IMAGE_URL_REFUSED,
    INVALID_IMAGE_URL,
    UNSUPPORTED_IMAGE_FORMAT,
    MediaError,
)
from router.media.limits import MediaLimits
from router.media.sources import may_be_image

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024
_HEADERS = {"User-Agent": "Roundhouse-image-fetcher/1", "Accept": "image/*"}
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def is_public_address(ip: IpAddress) -> bool:
    """Whether an address is on the public internet (the SSRF guard's test)."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and not is_public_address(embedded):
            return False
    return ip.is_global and not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
        or ip.is_reserved or ip.is_unspecified)


class AddressRefused(Exception):
    """A host resolved to an address the fetcher may not connect to. Not an
    OSError on purpose: aiohttp would wrap that in a DNS error and lose it."""

    def __init__(self, host: str, address: str):
        super().__init__(f"{host} resolves to {address}")
        self.host = host
        self.address = address


class _CheckedResolver(AbstractResolver):
    """Resolves names with aiohttp's resolver, then refuses any answer the
    fetcher does not allow; the connection uses exactly these addresses."""

    def __init__(self, fetcher: ImageFetcher):
        self._inner = DefaultResolver()
        self._fetcher = fetcher

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        for result in results:
            try:
                ip = ipaddress.ip_address(result["host"])
            except ValueError:
                raise AddressRefused(host, result["host"]) from None
            if not self._fetcher.address_allowed(ip):
                raise AddressRefused(host, result["host"])
        return results

    async def close(self) -> None:
        await self._inner.close()


class ImageFetcher:
    """Downloads image URLs under MediaLimits (bytes, time, redirects) and the
    SSRF guard above. One per router; `close()` it on shutdown."""

    def __init__(self, limits: MediaLimits | None = None, *,
                 allow_private_addresses: bool = False):
        self.limits = limits or MediaLimits()
        self.allow_private_addresses = allow_private_addresses
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def address_allowed(self, ip: IpAddress) -> bool:
        return self.allow_private_addresses or is_public_address(ip)

    async def fetch(self, url: str, param: str) -> bytes:
        """The body of `url`, or a MediaError naming `param`."""
        try:
            async with asyncio.timeout(self.limits.fetch_timeout_s):
                return await self._follow(url, param)
        except TimeoutError:
            raise MediaError(f"fetching the image URL took longer than "
                             f"{self.limits.fetch_timeout_s:g} s",
                             code=IMAGE_FETCH_TIMEOUT, param=param) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> ImageFetcher:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def _session_for_loop(self) -> aiohttp.ClientSession:
        # A session belongs to the loop it was made on; the router has one
        # loop, tests make one per test.
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session_loop = loop
            connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self), use_dns_cache=False,
                                             limit=64)
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=self.limits.fetch_timeout_s))
        return self._session

    async def _follow(self, url: str, param: str) -> bytes:
        session = self._session_for_loop()
        try:
            current = URL(url)
        except (ValueError, TypeError):
            raise MediaError("the image URL is not a valid URL", code=INVALID_IMAGE_URL,
                             param=param) from None
        for _ in range(self.limits.max_redirects + 1):
            self._check_hop(current, param)
            try:
                async with session.get(current, allow_redirects=False, headers=_HEADERS) as response:
                    if response.status in _REDIRECT_STATUSES:
                        current = self._redirect_target(current, response, param)
                        continue
                    if response.status != 200:
                        raise MediaError(f"the image URL answered HTTP {response.status}",
                                         code=IMAGE_FETCH_FAILED, param=param)
                    content_type = response.headers.get("Content-Type", "")
                    if not may_be_image(content_type):
                        raise MediaError(f"the image URL answered with content type "
                                         f"{content_type!r}, not an image",
                                         code=UNSUPPORTED_IMAGE_FORMAT, param=param)
                    return await self._read_body(response, param)
            except AddressRefused as refused:
                raise _refused(f"{refused.host} resolves to {refused.address}", param) from None
            except aiohttp.ClientError as error:
                raise MediaError(f"fetching the image URL failed: {_describe(error)}",
                                 code=IMAGE_FETCH_FAILED, param=param) from None
        raise MediaError(f"the image URL redirected more than {self.limits.max_redirects} times",
                         code=IMAGE_FETCH_FAILED, param=param)

    def _check_hop(self, url: URL, param: str) -> None:
        if url.scheme not in ("http", "https") or not url.host:
            raise MediaError("an image URL (and every redirect) must be http or https with a host",
                             code=INVALID_IMAGE_URL, param=param)
        try:
            ip = ipaddress.ip_address(url.host)
        except ValueError:
            return  # a name: the connection's resolver checks its addresses
        if not self.address_allowed(ip):
            raise _refused(f"{url.host} is not a public address", param)

    @staticmethod
    def _redirect_target(current: URL, response: aiohttp.ClientResponse, param: str) -> URL:
        location = response.headers.get("Location")
        if not location:
            raise MediaError(f"the image URL answered HTTP {response.status} without a Location",
                             code=IMAGE_FETCH_FAILED, param=param)
        try:
            return current.join(URL(location))
        except (ValueError, TypeError):
            raise MediaError("the image URL redirected to an invalid URL",
                             code=IMAGE_FETCH_FAILED, param=param) from None

    async def _read_body(self, response: aiohttp.ClientResponse, param: str) -> bytes:
        limit = self.limits.max_image_bytes
        declared = response.content_length
        # A compressed body's length says little about the image's size; the
        # streamed count below is what counts then.
        if declared is not None and declared > limit and "Content-Encoding" not in response.headers:
            response.close()
            raise _too_large(f"{declared} bytes", limit, param)
        body = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
            body += chunk
            if len(body) > limit:
                # Drop the connection rather than drain the rest of the body.
                response.close()
                raise _too_large(f"more than {limit} bytes", limit, param)
        return bytes(body)


def _refused(why: str, param: str) -> MediaError:
    return MediaError(f"the image URL is refused: {why} (this server only fetches images from "
                      "public addresses)", code=IMAGE_URL_REFUSED, param=param)


def _too_large(size: str, limit: int, param: str) -> MediaError:
    return MediaError(f"the image at the URL has {size}, over the limit of {limit} bytes",
                      code=IMAGE_TOO_LARGE, param=param)


def _describe(error: aiohttp.ClientError) -> str:
    # aiohttp's messages name the host and the OS error; they hold nothing the
    # client did not send us, so they are safe to pass on.
    return str(error) or type(error).__name__
