"""Where a prompt's images go: the token accounting between a rendered and
tokenized prompt and the Generate the engine gets.

A Qwen-VL chat template renders each {"type": "image"} part as
<|vision_start|><|image_pad|><|vision_end|>: one image token per image. The
engine needs one image token per vision-tower output row, so each becomes
the image's num_tokens image tokens, and the image an ImageInput whose
offset is the index of the first of them in the expanded prompt. Every count
the router reports (usage, count_tokens, input_tokens, the context check)
is of the expanded prompt, which is what the engine computes.

The image tokens of a prompt must be exactly the images' tokens: a template
that drops an image, or text that spells the image token itself, would give
the engine image tokens without an image (or an image without its tokens),
so both are a 400 images_not_placed.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol import ImageInput
from router.errors import InvalidRequest, invalid
from router.media.types import ImageRef, PreparedImage, VisionSpec

IMAGES_NOT_PLACED = "images_not_placed"


def image_input(image: PreparedImage, offset: int) -> ImageInput:
    """The engine's view of an image whose first image token is at `offset`."""
    return ImageInput(offset=offset, grid_t=image.grid_t, grid_h=image.grid_h, grid_w=image.grid_w,
                      width=image.width, height=image.height, digest=image.digest, rgb=image.rgb)


def expand_image_tokens(ids: Sequence[int], images: Sequence[PreparedImage],
                        refs: Sequence[ImageRef], spec: VisionSpec, *, param: str
                        ) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt with its k-th image token repeated images[k].num_tokens
    times, and the images at their offsets. `refs` name the images' fields
    and `param` the prompt's (e.g. "messages") in the error."""
    token = spec.image_token_id
    found = [index for index, token_id in enumerate(ids) if token_id == token]
    if len(found) != len(images):
        raise _not_placed(len(found), len(images), spec,
                          refs[len(found)].param if len(found) < len(images) else param)
    expanded: list[int] = []
    inputs: list[ImageInput] = []
    start = 0
    for position, image in zip(found, images, strict=True):
        expanded.extend(ids[start:position])
        inputs.append(image_input(image, len(expanded)))
        expanded.extend([token] * image.num_tokens)
        start = position + 1
    expanded.extend(ids[start:])
    return expanded, tuple(inputs)


def check_image_tokens(ids: list[int], images: Sequence[PreparedImage], spec: VisionSpec, *,
                       param: str) -> None:
    """For a prompt whose image tokens the router wrote itself (llama.cpp's
    multimodal prompt, a token-id prompt): its text holds none of its own."""
    extra = ids.count(spec.image_token_id) - sum(image.num_tokens for image in images)
    if extra:
        raise _not_placed(len(images) + extra, len(images), spec, param)


def _not_placed(found: int, images: int, spec: VisionSpec, param: str) -> InvalidRequest:
    if found < images:
        why = (f"the model's chat template did not place the images: the prompt holds {found} "
               f"image tokens (id {spec.image_token_id}) for {images} images; serve the model with "
               "a chat template that renders {\"type\": \"image\"} content parts (Qwen-VL's "
               "renders <|vision_start|><|image_pad|><|vision_end|>)")
    else:
        why = (f"the prompt holds {found} image tokens (id {spec.image_token_id}) for {images} "
               "images: the text may not spell the model's image token itself")
    return invalid(why, param, IMAGES_NOT_PLACED)
