"""The bounds that make a step with images' device memory finite
(engine/execution/vision_memory.py): tower passes of at most the largest
image's patches, embeddings kept only while an image has tokens left to
compute, none kept by a preempted sequence, and the step's peak set aside
for them."""

from __future__ import annotations

import random

import pytest
import torch

import protocol as p
from engine.execution.vision_encoder import load_vision_encoder
from engine.execution.vision_memory import VisionPeaks, blank_image, largest_image_grid
from engine.scheduling.scheduler import SchedulerOutput
from protocol.vision import VisionSpec
from router.media.resize import smart_resize
from tests.engine.in_process import SMALL_STEPS, make_engine, step_outputs
from tests.engine.test_vision_engine import (
    CLIP_MEAN,
    CLIP_STD,
    TEXT,
    Served,
    greedy,
    hf_generate,
    picture,
    prompt_with,
    write_processor_config,
)
from tests.support.tiny_vl_models import build_tiny_vl_model

QWEN_SPEC = VisionSpec(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136,
                       max_pixels=12845056, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                       image_token_id=1, vision_start_token_id=2, vision_end_token_id=3)


def test_the_largest_grid_bounds_every_resized_image() -> None:
    grid_h, grid_w = largest_image_grid(QWEN_SPEC)
    assert (grid_h, grid_w) == (256, 256)  # 16,384 image tokens: Qwen2.5-VL's max_pixels
    rng = random.Random(0)
    factor = QWEN_SPEC.patch_size * QWEN_SPEC.merge_size
    for _ in range(20000):
        height, width = rng.randint(1, 20000), rng.randint(1, 20000)
        if max(height, width) / min(height, width) > 200:
            continue
        h, w = smart_resize(height, width, factor, QWEN_SPEC.min_pixels, QWEN_SPEC.max_pixels)
        assert (h // 14) * (w // 14) <= grid_h * grid_w
    # A max_pixels that is no square number of cells: the best rectangle.
    odd = VisionSpec(**{**{f: getattr(QWEN_SPEC, f) for f in QWEN_SPEC.__dataclass_fields__},
                        "max_pixels": 99 * factor * factor})
    assert largest_image_grid(odd) == (9 * 2, 11 * 2)


def test_an_image_step_sets_aside_the_pass_and_the_embeddings_it_reads() -> None:
    peaks = VisionPeaks(pass_bytes=1000, output_bytes_per_token=10, max_image_tokens=50)
    # The pass, with the embeddings of earlier passes kept beside it...
    assert peaks.image_step_bytes(prefill_bytes=0, max_batched_tokens=100) == 1000 + 150 * 10
    # ...or the text prefill's peak with every embedding its forward reads.
    assert peaks.image_step_bytes(prefill_bytes=5000, max_batched_tokens=100) == 5000 + 200 * 10


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = build_tiny_vl_model("qwen2_5_vl", path)
    patch = hf.config.vision_config.patch_size
    write_processor_config(path, patch, CLIP_MEAN, CLIP_STD)
    return Served("qwen2_5_vl", path, hf, patch, CLIP_MEAN, CLIP_STD)


def test_tower_passes_hold_at_most_the_largest_image(served: Served) -> None:
    encoder = load_vision_encoder(served.path, torch.device("cpu"), torch.float32)
    # The processor config allows 4096 patches: a pass of 4096 at most.
    assert largest_image_grid(encoder.spec) == (64, 64)
    big = blank_image(encoder.spec, 64, 64)
    small = [blank_image(encoder.spec, 8, 12), blank_image(encoder.spec, 12, 8)]
    passes: list[int] = []
    forward = encoder.tower.forward

    def counted(patches: torch.Tensor, grids: list[tuple[int, int, int]]):
        passes.append(patches.shape[0])
        return forward(patches, grids)

    encoder.tower.forward = counted  # type: ignore[method-assign]
    together = encoder.encode([small[0], big, small[1]])
    assert passes == [96, 4096, 96]
    passes.clear()
    assert [len(x.embeddings) for x in encoder.encode(small)] == [24, 24]
    assert passes == [192]  # small images share a pass
    alone = encoder.encode([small[0]])[0]
    torch.testing.assert_close(together[0].embeddings, alone.embeddings, rtol=1e-5, atol=1e-5)


def test_images_are_kept_only_while_their_tokens_are_computed_and_not_when_preempted(
        served: Served) -> None:
    # Steps of 24 tokens: the first reaches the 6-token image and the
    # 24-token one; the small one is done in that step, the big one is cut.
    small = (picture((1, 4, 6), served.patch, 1), (1, 4, 6))
    requests = {}
    for seed, name in enumerate(("a", "b", "c")):
        # A different image each, so that no prompt is another's cache hit.
        big = (picture((1, 8, 12), served.patch, 10 + seed), (1, 8, 12))
        prompt, images = prompt_with([small, big], [TEXT[:6], TEXT[:6], TEXT])
        requests[name] = (prompt, images, hf_generate(served, prompt, [small, big]))
    # 13 pages for three 7-page prompts (2 pages shared) that grow by one, no output
    # window reserved at admission: preemption.
    options = {**SMALL_STEPS, "kv_capacity_tokens": 104, "output_window": 0}
    core, events = make_engine(served.path, vision=True, **options)
    for name, (prompt, images, expected) in requests.items():
        core.handle(p.Generate(name, prompt, greedy(len(expected)), images=images))
    kept: list[int] = []
    while core.has_work:
        core.step()
        for seq in core.scheduler.running:
            if seq.media is not None:
                kept.append(len(seq.media.encoded))
                for index in seq.media.encoded:
                    offset, count = seq.media.spans[index]
                    assert offset + count > seq.num_computed_tokens, "a computed image is kept"
        for seq in core.scheduler.waiting:
            assert seq.media is None or not seq.media.encoded, "a waiting sequence holds images"
    assert core.scheduler.num_preemptions > 0
    assert max(kept) == 1
    tokens: dict[str, list[int]] = {}
    for event in events:
        assert not isinstance(event, p.RequestError), event
        if isinstance(event, p.StepOutputs):
            for output in event.outputs:
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
    assert tokens == {name: expected for name, (_, _, expected) in requests.items()}


def test_a_sequence_preempted_mid_image_drops_it_and_encodes_it_again(served: Served) -> None:
    small = (picture((1, 4, 6), served.patch, 1), (1, 4, 6))
    big = (picture((1, 8, 12), served.patch, 2), (1, 8, 12))
    prompt, images = prompt_with([small, big], [TEXT[:6], TEXT[:6], TEXT])
    expected = hf_generate(served, prompt, [small, big])
    core, events = make_engine(served.path, vision=True, **SMALL_STEPS)
    core.handle(p.Generate("a", prompt, greedy(len(expected)), images=images))
    core.step()  # 24 tokens: the small image whole, the big one cut
    [seq] = core.scheduler.running
    assert seq.media is not None and list(seq.media.encoded) == [1]
    # As the scheduler preempts when the pool runs out (the step is done).
    core.scheduler._preempt(seq, SchedulerOutput())
    assert not seq.media.encoded
    while core.has_work:
        core.step()
    assert [t for o in step_outputs(events) for t in o.token_ids] == expected


def test_blank_image_is_what_the_router_sends() -> None:
    image = blank_image(QWEN_SPEC, 4, 6)
    assert (image.width, image.height) == (6 * 14, 4 * 14)
    assert len(image.rgb) == image.width * image.height * 3
    assert image.num_tokens(QWEN_SPEC.merge_size) == 6
