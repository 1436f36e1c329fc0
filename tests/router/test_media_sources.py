"""data: URIs and bare base64 to image bytes (router/media/sources.py)."""

from __future__ import annotations

import asyncio
import base64

import pytest

from router.media.errors import MediaError
from router.media.sources import (
    data_uri_from_base64,
    decode_base64,
    decode_data_uri,
    may_be_image,
    read_image_bytes,
)
from router.media.types import ImageRef

PARAM = "messages[0].content[1].image_url"


def refused(call, code: str) -> MediaError:
    with pytest.raises(MediaError) as caught:
        call()
    assert caught.value.code == code
    assert caught.value.param == PARAM
    assert caught.value.status == 400
    return caught.value


def test_a_base64_data_uri_gives_its_bytes() -> None:
    payload = bytes(range(256)) * 3
    uri = "data:image/png;base64," + base64.b64encode(payload).decode()
    assert decode_data_uri(uri, PARAM, 10_000) == payload


def test_data_uris_as_clients_send_them_decode() -> None:
    payload = bytes(range(200))
    text = base64.b64encode(payload).decode()
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    urlsafe = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    percent = text.replace("+", "%2B").replace("/", "%2F").replace("=", "%3D")
    for uri in (f"data:image/jpeg;base64,{wrapped}", f"data:image/webp;base64,{urlsafe}",
                f"data:image/png;base64,{percent}", f"data:;base64,{text}",
                f"DATA:IMAGE/PNG;charset=x;BASE64,{text}"):
        assert decode_data_uri(uri, PARAM, 1000) == payload


def test_a_data_uri_over_the_byte_limit_is_refused() -> None:
    uri = "data:image/png;base64," + base64.b64encode(b"x" * 1001).decode()
    error = refused(lambda: decode_data_uri(uri, PARAM, 1000), "image_too_large")
    assert "1000" in error.message
    assert decode_data_uri("data:image/png;base64," + base64.b64encode(b"x" * 1000).decode(),
                           PARAM, 1000) == b"x" * 1000


def test_a_huge_data_uri_is_refused_before_it_is_decoded(monkeypatch) -> None:
    def no_decode(*args, **kwargs):
        raise AssertionError("decoded a payload it should have refused by its length")

    monkeypatch.setattr(base64, "b64decode", no_decode)
    refused(lambda: decode_base64("A" * 4_000_000, PARAM, 1_000_000), "image_too_large")


def test_a_non_image_data_uri_is_refused() -> None:
    uri = "data:text/plain;base64," + base64.b64encode(b"hello").decode()
    refused(lambda: decode_data_uri(uri, PARAM, 1000), "unsupported_image_format")


@pytest.mark.parametrize("uri", ["data:image/png,rawbytes", "data:image/png;base64",
                                 "data:image/png;base64,!!!not base64!!!"])
def test_malformed_data_uris_are_refused(uri: str) -> None:
    refused(lambda: decode_data_uri(uri, PARAM, 1000), "invalid_image_url")


def test_bare_base64_becomes_a_data_uri_the_loader_reads() -> None:
    text = base64.b64encode(b"\x89PNG\r\n\x1a\nrest").decode()
    assert data_uri_from_base64(text).startswith("data:application/octet-stream;base64,")
    assert data_uri_from_base64(text, "image/png") == f"data:image/png;base64,{text}"
    assert decode_data_uri(data_uri_from_base64(text), PARAM, 100) == b"\x89PNG\r\n\x1a\nrest"


def test_declared_types_are_checked_loosely() -> None:
    for media_type in ("image/png", "IMAGE/JPEG; q=1", "", "application/octet-stream",
                       "binary/octet-stream", "image/svg+xml"):
        assert may_be_image(media_type), media_type
    for media_type in ("text/html; charset=utf-8", "application/json", "video/mp4"):
        assert not may_be_image(media_type), media_type


def test_urls_without_a_fetcher_and_other_schemes_are_refused() -> None:
    def read(url: str) -> bytes:
        return asyncio.run(read_image_bytes(ImageRef(url, PARAM), 1000, None))

    refused(lambda: read("https://example.com/cat.png"), "image_url_refused")
    refused(lambda: read("file:///etc/passwd"), "invalid_image_url")
    refused(lambda: read("ftp://example.com/cat.png"), "invalid_image_url")
    assert read("data:image/png;base64,AAAA") == b"\x00\x00\x00"
