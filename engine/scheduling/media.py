"""What a sequence with images carries besides its tokens.

- Its images (protocol ImageInput) and where their tokens lie in the prompt.
- Multimodal RoPE positions: the prompt's [3, P] positions, and delta, the
  shift of every later token's position from its index (engine/models/mrope.py).
- Its cache key ids: the prompt's token ids with each image token replaced by
  an id drawn from the image's digest and the token's place in the image, so
  the prefix cache (every tier, and the token-by-token checks of partial
  pages) tells two images apart, and finds the same image again, without
  knowing about images. The ids lie in [2**31, 2**32): no vocabulary's token
  ids, never a placeholder (those are negative).
- The tower's output for its images while the prompt is prefilled (the model
  runner fills it when a step first reaches an image and drops it in the
  step that computes the image's last token; a preemption drops it too:
  engine/execution/vision_memory.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.models.mrope import mrope_positions
from protocol import ImageInput

if TYPE_CHECKING:  # the model runner's type; scheduling only holds it
    from engine.execution.vision_encoder import EncodedImage

_KEY_BASE = 2**31


def image_key_ids(digest: bytes, count: int) -> list[int]:
    """count ids standing for the tokens of the image with this digest."""
    ids = []
    for index in range(count):
        h = hashlib.blake2b(digest + index.to_bytes(4, "little"), digest_size=4).digest()
        ids.append(_KEY_BASE + (int.from_bytes(h, "little") & (_KEY_BASE - 1)))
    return ids


@dataclass
class SequenceMedia:
    images: list[ImageInput]
    # (offset, count) of each image's tokens in the prompt, in prompt order.
    spans: list[tuple[int, int]]
    positions3: torch.Tensor  # int64 [3, P] on the CPU
    delta: int
    key_ids: list[int]  # the prompt's ids as the prefix cache keys them
    # Per image, its tower output while the prompt is being prefilled.
    encoded: dict[int, EncodedImage] = field(default_factory=dict)

    @classmethod
    def build(cls, prompt: list[int], images: list[ImageInput], image_token_id: int,
              merge_size: int) -> SequenceMedia:
        """ValueError when the images' tokens are not where they say."""
        ordered = sorted(images, key=lambda image: image.offset)
        spans: list[tuple[int, int]] = []
        end = 0
        keys = list(prompt)
        for number, image in enumerate(ordered):
            count = image.num_tokens(merge_size)
            if image.offset < end or image.offset + count > len(prompt) or any(
                    token != image_token_id for token in prompt[image.offset:image.offset + count]):
                raise ValueError(f"image {number} (offset {image.offset}, {count} tokens) does "
                                 "not match the prompt's image tokens")
            spans.append((image.offset, count))
            keys[image.offset:image.offset + count] = image_key_ids(image.digest, count)
            end = image.offset + count
        grids = [(image.grid_t, image.grid_h, image.grid_w) for image in ordered]
        positions, delta = mrope_positions(prompt, grids, image_token_id, merge_size)
        return cls(ordered, spans, positions, delta, keys)

    def images_in(self, start: int, end: int) -> list[int]:
        """Indices of the images with a token in prompt[start:end]."""
        return [i for i, (offset, count) in enumerate(self.spans)
                if offset < end and start < offset + count]
