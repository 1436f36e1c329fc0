"""A step's multimodal inputs: the vision tower's embeddings at the image
tokens its chunks compute, and multimodal RoPE's table for all its rows.

Images are encoded when a step first reaches one of their tokens (the
images new to the step in tower passes of bounded size: VisionEncoder.encode),
kept on their sequence while a chunked prefill has tokens of theirs still to
compute, and dropped in the step that computes their last token, so a
sequence holds at most the one image its chunk boundary cuts (the bound
engine/execution/vision_memory.py sets device memory aside for). A preempted
sequence encodes them again if it must compute them again.
"""

from __future__ import annotations

import torch

from engine.execution.step_inputs import StepInputs
from engine.execution.vision_encoder import VisionEncoder
from engine.models import CausalLM
from engine.models.mrope import mrope_rope_table
from engine.models.multimodal_inputs import MultimodalStepInputs
from engine.scheduling.media import SequenceMedia


def _encode_new_images(vision: VisionEncoder, inputs: StepInputs) -> None:
    pending: list[tuple[SequenceMedia, int]] = []
    for chunk in inputs.media_chunks:
        media = chunk.seq.media
        assert media is not None
        for index in media.images_in(chunk.start, chunk.start + chunk.num_tokens):
            if index not in media.encoded and (media, index) not in pending:
                pending.append((media, index))
    if not pending:
        return
    encoded = vision.encode([media.images[index] for media, index in pending])
    for (media, index), image in zip(pending, encoded, strict=True):
        media.encoded[index] = image


def multimodal_step_inputs(vision: VisionEncoder, model: CausalLM, inputs: StepInputs,
                           positions: torch.Tensor) -> MultimodalStepInputs:
    """positions: the step's RoPE positions on the device (StepInputs.positions:
    a token after a prompt with images already at its index plus delta)."""
    _encode_new_images(vision, inputs)
    device = positions.device
    config = model.config
    positions3 = torch.from_numpy(inputs.positions).expand(3, -1).clone()
    rows: list[torch.Tensor] = []
    embeddings: list[torch.Tensor] = []
    deepstack: list[list[torch.Tensor]] = []
    for chunk in inputs.media_chunks:
        seq = chunk.seq
        media = seq.media
        assert media is not None
        end = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens)
        first = chunk.first_row
        positions3[:, first:first + end - chunk.start] = media.positions3[:, chunk.start:end]
        for index in media.images_in(chunk.start, end):
            offset, count = media.spans[index]
            lo, hi = max(offset, chunk.start), min(offset + count, end)
            rows.append(torch.arange(first + lo - chunk.start, first + hi - chunk.start))
            image = media.encoded[index]
            embeddings.append(image.embeddings[lo - offset:hi - offset])
            if not deepstack:
                deepstack = [[] for _ in image.deepstack]
            for layer, feature in enumerate(image.deepstack):
                deepstack[layer].append(feature[lo - offset:hi - offset])
            if offset + count <= end:
                del media.encoded[index]  # its last token is computed in this step
    table = mrope_rope_table(positions3, model.rope_cache, config.mrope_section,
                             config.mrope_interleaved)
    if not rows:
        empty = torch.empty(0, config.hidden_size, dtype=model.embed_tokens.dtype, device=device)
        return MultimodalStepInputs(torch.empty(0, dtype=torch.int64, device=device), empty,
                                    table)
    return MultimodalStepInputs(
        torch.cat(rows).to(device, non_blocking=True),
        torch.cat(embeddings),
        table,
        tuple(torch.cat(layer) for layer in deepstack),
    )
