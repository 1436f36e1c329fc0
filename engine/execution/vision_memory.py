"""Device memory a step with images needs beyond a text step, so that the
KV pool is sized with room for it (engine/execution/gpu_memory.py).

A step with images first runs the vision tower over the images new to it,
then the model's forward with their embeddings in hand. Two bounds make
that memory finite and measurable:
- each tower pass covers at most the patches of the largest image the
  model's processor allows (VisionEncoder.encode splits a step's images
  into such passes), so one pass over that image is the tower's peak;
- a sequence keeps an image's embeddings only while its prefill has tokens
  of that image still to compute (engine/execution/multimodal_step.py), so
  a step's forward holds the embeddings of at most its own tokens plus the
  two images its chunk boundaries may cut.

The profile runs one pass over a blank image of the largest grid and reads
torch's peak; the step's peak is the larger of (that pass + the embeddings
kept from earlier passes) and (the text prefill's peak + the embeddings its
forward reads).
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protocol import ImageInput
from protocol.vision import VisionSpec

if TYPE_CHECKING:
    from engine.execution.vision_encoder import VisionEncoder

log = logging.getLogger(__name__)


def largest_image_grid(spec: VisionSpec) -> tuple[int, int]:
    """(grid_h, grid_w) in patches of the image with the most patches that
    the processor's resize can produce: sides are multiples of patch_size *
    merge_size with height * width <= max_pixels."""
    factor = spec.patch_size * spec.merge_size
    units = max(1, spec.max_pixels // (factor * factor))
    # The factor-sized cells of the largest rectangle that fits: a side of
    # a cells and the other of units // a, the best over a <= sqrt(units),
    # the squarest of equals (as memory goes, all equals are alike).
    best = max(((a, units // a) for a in range(1, math.isqrt(units) + 1)),
               key=lambda sides: (sides[0] * sides[1], sides[0]))
    return best[0] * spec.merge_size, best[1] * spec.merge_size


def blank_image(spec: VisionSpec, grid_h: int, grid_w: int) -> ImageInput:
    """A black image of that grid, as the router would send it."""
    height, width = grid_h * spec.patch_size, grid_w * spec.patch_size
    rgb = bytes(height * width * 3)
    return ImageInput(offset=0, grid_t=1, grid_h=grid_h, grid_w=grid_w, width=width,
                      height=height, digest=hashlib.sha256(rgb).digest(), rgb=rgb)


@dataclass(frozen=True)
class VisionPeaks:
    pass_bytes: int  # one tower pass over the largest image, its outputs included
    output_bytes_per_token: int  # embeddings (+ deepstack features) per image token
    max_image_tokens: int  # the largest image's tokens

    def image_step_bytes(self, prefill_bytes: int, max_batched_tokens: int) -> int:
        """The peak of a step with images, beyond the weights and KV, given
        the text prefill step's peak."""
        kept_before_forward = (max_batched_tokens + self.max_image_tokens) * self.output_bytes_per_token
        read_by_forward = (max_batched_tokens + 2 * self.max_image_tokens) * self.output_bytes_per_token
        return max(self.pass_bytes + kept_before_forward, prefill_bytes + read_by_forward)


@torch.inference_mode()
def profile_vision_pass(encoder: VisionEncoder) -> VisionPeaks:
    """Run the tower once over a blank image of the largest grid on its
    device and measure what the pass takes."""
    device = encoder.device
    grid_h, grid_w = largest_image_grid(encoder.spec)
    image = blank_image(encoder.spec, grid_h, grid_w)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    [encoded] = encoder.encode([image])
    torch.cuda.synchronize(device)
    pass_bytes = torch.cuda.max_memory_allocated(device) - base
    tokens = encoded.embeddings.shape[0]
    outputs = sum(t.numel() * t.element_size() for t in (encoded.embeddings, *encoded.deepstack))
    del encoded  # before the cache is emptied, so its blocks go back to the device
    torch.cuda.empty_cache()
    peaks = VisionPeaks(pass_bytes, outputs // tokens, tokens)
    log.info("vision tower: one pass over the largest image (%dx%d pixels, %d image tokens) "
             "peaks at %.0f MiB", grid_w * encoder.spec.patch_size, grid_h * encoder.spec.patch_size,
             tokens, pass_bytes / 2**20)
    return peaks
