"""Images in chat messages, in the one shape every chat-shaped API hands on.

Each API reads its own image parts (Chat Completions `image_url`, Responses
`input_image`, Anthropic `image` blocks) into ImageRefs (router/media/types.py),
kept in the order they appear in the rendered conversation, and leaves a
`{"type": "image"}` part where each stood in its message: the part Qwen-VL
chat templates iterate over and replace with the image's placeholder tokens.
A message that holds no image keeps string content, exactly as before images
were accepted, so text requests render as they always did.
"""

from __future__ import annotations

from typing import Any, get_args

from router.errors import invalid
from router.media.types import Detail, ImageRef

DETAILS: tuple[str, ...] = get_args(Detail)


def image_part() -> dict[str, Any]:
    """What a template sees where an image stood."""
    return {"type": "image"}


def detail_of(value: Any, param: str) -> Detail:
    """`detail` as OpenAI's APIs spell it; absent means auto."""
    if value is None:
        return "auto"
    if value not in DETAILS:
        raise invalid(f"'{param}' must be one of {', '.join(DETAILS)}, got {value!r}", param)
    return value  # type: ignore[no-any-return]


def image_url(value: Any, param: str) -> str:
    """A URL field's value: a non-empty string. Whether it is a data: URI or
    an http(s) URL the media loader decides, with its own error."""
    if value is None:
        raise invalid(f"missing required parameter '{param}'", param, "missing_required_parameter")
    if not isinstance(value, str):
        raise invalid(f"'{param}' must be a string (a data: URI or an http(s) URL)", param,
                      "invalid_type")
    if not value.strip():
        raise invalid(f"'{param}' is empty; send a data: URI or an http(s) URL", param)
    return value


class MessageContent:
    """One message's content as it is read: its text parts in order, and its
    images, which also join the request's list (`images`, shared by every
    message of the request, so the list follows the conversation's order)."""

    def __init__(self, images: list[ImageRef]) -> None:
        self._images = images
        self._parts: list[dict[str, Any]] = []
        self.has_image = False

    def __bool__(self) -> bool:
        return bool(self._parts)

    def text(self, text: str) -> None:
        self._parts.append({"type": "text", "text": text})

    def image(self, ref: ImageRef) -> None:
        self._images.append(ref)
        self._parts.append(image_part())
        self.has_image = True

    def texts(self) -> list[str]:
        return [part["text"] for part in self._parts if part["type"] == "text"]

    def content(self, joiner: str = "\n") -> str | list[dict[str, Any]]:
        """A string (the texts joined, as text-only messages always were), or
        the list of text and image parts when the message holds an image."""
        if not self.has_image:
            return joiner.join(self.texts())
        return list(self._parts)
