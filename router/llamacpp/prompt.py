"""/completion's `prompt` in every shape llama.cpp accepts, turned into token ids.

    "text"                                    a string
    [12, 34, 56]                              token ids
    [12, 34, "text", 56]                      a mix: strings are tokenized in place
    {"prompt_string": "text"}                 llama.cpp's multimodal form, without media
    {"prompt_string": "a <__media__> b",      ... and with it: one base64 image per
     "multimodal_data": ["<base64>"]}          media marker, in order (a MediaPrompt)
    ["text"], [[12, 34]], [[12, "text"]]      a list holding one of the above

A BOS token is put in front, when the model wants one, only if the prompt
starts with a string (llama.cpp's rule). Several prompts in one request
(["a", "b"]) are refused: this server answers one prompt per request.

A MediaPrompt's images go between its segments as <|vision_start|>, the
image's tokens and <|vision_end|>, which is what llama.cpp's mtmd writes for
Qwen-VL models; its segments are tokenized one by one as mtmd tokenizes its
text chunks (the first with the model's BOS, special tokens parsed in all).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol import ImageInput
from router.http.errors import invalid
from router.media.image_loader import ImageLoader
from router.media.placement import check_image_tokens, image_input
from router.media.sources import data_uri_from_base64
from router.media.types import ImageRef, PreparedImage, VisionSpec
from router.text.model_text import ModelText

# llama.cpp's placeholder for media in a multimodal prompt (mtmd_default_marker).
MEDIA_MARKER = "<__media__>"
# How base64 data starts for each image format (its magic bytes), so that the
# data: URI names its type; the media loader reads the bytes themselves.
_BASE64_MAGIC = (("iVBORw0KGgo", "image/png"), ("/9j/", "image/jpeg"), ("R0lGOD", "image/gif"),
                 ("UklGR", "image/webp"), ("Qk", "image/bmp"))


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt object with multimodal_data: prompt_string cut at each media
    marker, so that segments[i] comes before images[i] and segments[-1]
    after the last image (len(segments) == len(images) + 1)."""

    segments: tuple[str, ...]
    images: tuple[ImageRef, ...]

    @property
    def text(self) -> str:
        """prompt_string as the client wrote it, markers included."""
        return MEDIA_MARKER.join(self.segments)


PromptParts = str | list[int | str] | MediaPrompt


def _is_id(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def _is_mix(items: list[Any]) -> bool:
    """Token ids, or ids and strings together (llama.cpp's "mixed" prompt)."""
    return all(_is_id(i) or isinstance(i, str) for i in items) and any(_is_id(i) for i in items)


def _from_object(value: dict[str, Any]) -> str | MediaPrompt:
    text = value.get("prompt_string")
    if not isinstance(text, str):
        raise invalid("a prompt object needs a string 'prompt_string'", "prompt.prompt_string",
                      "invalid_type")
    data = value.get("multimodal_data")
    if not data:
        return text
    if not isinstance(data, list):
        raise invalid("'prompt.multimodal_data' must be a list of base64 strings",
                      "prompt.multimodal_data", "invalid_type")
    images = tuple(_media(item, f"prompt.multimodal_data[{index}]") for index, item in enumerate(data))
    segments = tuple(text.split(MEDIA_MARKER))
    if len(segments) - 1 != len(images):
        raise invalid(f"'prompt.prompt_string' holds {len(segments) - 1} media markers "
                      f"({MEDIA_MARKER}) for {len(images)} items of 'prompt.multimodal_data'; "
                      "each item needs its own marker, in order", "prompt.multimodal_data")
    return MediaPrompt(segments, images)


def _media(item: Any, param: str) -> ImageRef:
    """One multimodal_data item: base64 data (llama.cpp's form) or a data: URI."""
    if not isinstance(item, str) or not item:
        raise invalid(f"'{param}' must be a string of base64 data", param, "invalid_type")
    if item.startswith("data:"):
        return ImageRef(item, param)
    media_type = next((kind for magic, kind in _BASE64_MAGIC if item.startswith(magic)),
                      "application/octet-stream")
    return ImageRef(data_uri_from_base64(item, media_type), param)


def prompt_images(parts: PromptParts) -> tuple[ImageRef, ...]:
    return parts.images if isinstance(parts, MediaPrompt) else ()


def prompt_parts(prompt: str | list[Any] | dict[str, Any]) -> PromptParts:
    """The one prompt of a request, as a string or a list of ids and strings."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        return _from_object(prompt)
    if not prompt:
        raise invalid("'prompt' is empty", "prompt")
    if _is_mix(prompt):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | dict | list):
        (single,) = prompt
        if isinstance(single, list) and not _is_mix(single):
            raise invalid("'prompt[0]' must be token ids or token ids mixed with strings", "prompt[0]",
                          "invalid_type")
        return prompt_parts(single)
    if len(prompt) > 1 and all(isinstance(p, str | list | dict) for p in prompt):
        raise invalid(f"'prompt' holds {len(prompt)} prompts; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a string, token ids, or token ids mixed with strings", "prompt",
                  "invalid_type")


async def completion_prompt(parts: PromptParts, text: ModelText, spec: VisionSpec | None,
                            images: ImageLoader) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt's token ids and its images at their offsets. `spec`: the
    model's, when it is served with --vision (a MediaPrompt needs one:
    require_vision has refused it otherwise)."""
    if spec is None:
        return await prompt_ids(parts, text), ()
    loaded: list[PreparedImage] = []
    if isinstance(parts, MediaPrompt):
        loaded = await images.load(parts.images, spec)
        ids, inputs = await _media_prompt_ids(parts, loaded, text, spec)
    else:
        ids, inputs = await prompt_ids(parts, text), ()
    # Only the image tokens written here: text (or ids) holding the image
    # token would give the engine image tokens without an image.
    check_image_tokens(ids, loaded, spec, param="prompt")
    return ids, inputs


async def _media_prompt_ids(parts: MediaPrompt, images: Sequence[PreparedImage], text: ModelText,
                            spec: VisionSpec) -> tuple[list[int], tuple[ImageInput, ...]]:
    ids = await text.encode_prompt_async(parts.segments[0])
    inputs = []
    for image, segment in zip(images, parts.segments[1:], strict=True):
        ids.append(spec.vision_start_token_id)
        inputs.append(image_input(image, len(ids)))
        ids += [spec.image_token_id] * image.num_tokens
        ids.append(spec.vision_end_token_id)
        ids += await text.tokenizer.encode_async(segment)
    return ids, tuple(inputs)


async def prompt_ids(parts: PromptParts, text: ModelText) -> list[int]:
    assert not isinstance(parts, MediaPrompt), "completion_prompt places a prompt's images"
    if isinstance(parts, str):
        ids = await text.encode_prompt_async(parts)
    else:
        ids = []
        for index, item in enumerate(parts):
            if isinstance(item, str):
                # Only a leading string gets the model's BOS.
                ids += (await text.encode_prompt_async(item) if index == 0
                        else await text.tokenizer.encode_async(item))
            else:
                ids.append(item)
    if not ids:
        raise invalid("'prompt' is empty", "prompt")
    bad = next((t for t in ids if t < 0), None)
    if bad is not None:
        raise invalid(f"token id {bad} in 'prompt' is negative", "prompt")
    return ids
