"""Why an image could not be used, in words a client can act on.

A MediaError is a RouterError of kind INVALID, so the one HTTP middleware
(router/http/errors.py) renders it in the shape of the API the request came
through: OpenAI's {"error": {message, type, param, code}}, Anthropic's
invalid_request_error, llama.cpp's {"error": {code, message, type, reason}}.
`param` names the request field that carried the image.

Every code answers 400. OpenAI and Anthropic both answer a per-image limit
(too many bytes, too many pixels, too many images) with 400
invalid_request_error; 413 is what they (and our middleware) keep for a
request body over the server's size limit, which a fetched URL never is.
"""

from __future__ import annotations

from router.errors import ErrorKind, RouterError

# The codes a MediaError carries; handlers and tests compare against these.
INVALID_IMAGE_URL = "invalid_image_url"  # not a data: URI or http(s) URL, bad base64
IMAGE_URL_REFUSED = "image_url_refused"  # SSRF guard: a private address, or URLs turned off
IMAGE_FETCH_FAILED = "image_fetch_failed"  # connection error, HTTP error status, redirect loop
IMAGE_FETCH_TIMEOUT = "image_fetch_timeout"  # the whole fetch ran past its time limit
IMAGE_TOO_LARGE = "image_too_large"  # over the byte limit or the pixel limit
UNSUPPORTED_IMAGE_FORMAT = "unsupported_image_format"  # not PNG/JPEG/WebP/GIF/BMP, or not an image
INVALID_IMAGE = "invalid_image"  # a supported format whose bytes do not decode
TOO_MANY_IMAGES = "too_many_images"  # more images in one request than allowed
TOO_MANY_IMAGE_TOKENS = "too_many_image_tokens"  # the request's images need too many vision tokens


class MediaError(RouterError):
    """An image of a request that cannot be used: `code` says why, `param`
    which request field carried it, `status` the HTTP status (always 400)."""

    kind = ErrorKind.INVALID

    def __init__(self, message: str, *, code: str, param: str | None):
        super().__init__(message, code=code, param=param)

    @property
    def status(self) -> int:
        return 400
