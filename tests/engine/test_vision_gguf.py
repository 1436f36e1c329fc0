"""Images through the engine from llama.cpp's GGUF pair (--vision --mmproj).

The tiny random Qwen2.5-VL and Qwen3-VL models of test_vision_engine.py are
converted as llama.cpp's converter lays them out (tests/support/vl_gguf.py):
the mmproj's tower equals the Hugging Face directory's (config and every
weight), and the engine on the pair gives transformers' greedy tokens for
prompts with one and two images, in float32 on the CPU; so does a Q8_0 text
GGUF against transformers on the same Q8_0-rounded weights. Pairs that do
not belong together are refused with the file and the reason.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import gguf
import pytest
import torch

import tests.engine.test_vision_engine as vision_engine_tests
from engine.execution.vision_encoder import load_gguf_vision_encoder, load_vision_encoder
from protocol.gguf_file import read_gguf_metadata
from protocol.vision_gguf import GGUFTextModel
from tests.engine.in_process import SMALL_STEPS, make_engine
from tests.engine.test_vision_engine import (  # noqa: F401  (served is a fixture)
    GRID_A,
    GRID_B,
    TEXT,
    Served,
    hf_generate,
    picture,
    prompt_with,
    run,
    served,
)
from tests.support.vl_gguf import float32_values, write_mmproj_gguf, write_vl_gguf_pair

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair(served: Served, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:  # noqa: F811
    return write_vl_gguf_pair(served.path, tmp_path_factory.mktemp(f"{served.arch}-gguf"))


def text_facts(text_gguf: Path) -> GGUFTextModel:
    return GGUFTextModel.from_metadata(read_gguf_metadata(text_gguf), text_gguf.name)


def test_mmproj_tower_equals_the_checkpoints(served: Served, pair: tuple[Path, Path]  # noqa: F811
                                             ) -> None:
    text, mmproj = pair
    ours = load_gguf_vision_encoder(mmproj, text_facts(text), CPU, torch.float32)
    reference = load_vision_encoder(served.path, CPU, torch.float32)
    # GGUF keeps floats in float32 (the engine computes in float32 from them).
    assert ours.tower.config == float32_values(reference.tower.config, "norm_eps")
    assert ours.spec == float32_values(reference.spec, "image_mean", "image_std")
    expected = reference.tower.state_dict()
    got = ours.tower.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_f16_mmproj_tower_is_the_checkpoints_in_half_precision(
        served: Served, pair: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    half = write_mmproj_gguf(served.path, tmp_path / "mmproj-F16.gguf",
                             matrices=gguf.GGMLQuantizationType.F16)
    ours = load_gguf_vision_encoder(half, text_facts(pair[0]), CPU, torch.float32)
    reference = load_vision_encoder(served.path, CPU, torch.float32).tower.state_dict()
    for name, tensor in ours.tower.state_dict().items():
        rounded = (reference[name].half().float()
                   if reference[name].ndim >= 2 and "pos_embed" not in name else reference[name])
        assert torch.equal(tensor, rounded), name


def images_and_prompts(patch: int):
    first = (picture(GRID_A, patch, 1), GRID_A)
    second = (picture(GRID_B, patch, 2), GRID_B)
    one = prompt_with([first], [TEXT[:3], TEXT[3:]])
    two = prompt_with([first, second], [TEXT[:2], TEXT[2:5], TEXT[5:]])
    return (first, second), one, two


def serve_pair(served: Served, text: Path, mmproj: Path, reference: Served) -> None:  # noqa: F811
    """The engine on the pair gives reference's transformers tokens for one
    and two images, batched with each other (24-token steps split them)."""
    (first, second), (one_prompt, one_images), (two_prompt, two_images) = \
        images_and_prompts(served.patch)
    expected_one = hf_generate(reference, one_prompt, [first])
    expected_two = hf_generate(reference, two_prompt, [first, second])
    core, events = make_engine(text, vision=True, mmproj=str(mmproj), **SMALL_STEPS)
    out = run(core, events, {"one": (one_prompt, one_images, len(expected_one)),
                             "two": (two_prompt, two_images, len(expected_two))})
    assert out["one"].token_ids == expected_one
    assert out["two"].token_ids == expected_two


def test_gguf_pair_gives_transformers_tokens(served: Served, pair: tuple[Path, Path]  # noqa: F811
                                             ) -> None:
    serve_pair(served, *pair, reference=served)


def q8_rounded(served: Served) -> Served:  # noqa: F811
    """served with every 2-D text weight rounded through Q8_0, as the Q8_0
    text GGUF stores them (the tower is untouched)."""
    model = copy.deepcopy(served.hf)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.ndim == 2 and "visual" not in name:
                blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
                rounded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
                weight.copy_(torch.from_numpy(rounded.reshape(weight.shape)))
    return Served(served.arch, served.path, model, served.patch, served.mean, served.std)


def test_q8_0_text_gguf_gives_transformers_tokens_on_its_weights(
        served: Served, pair: tuple[Path, Path], tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    if served.arch != "qwen3_vl":
        pytest.skip("one family is enough for the quantized text path")
    # 12 tokens: the two-image prompt's 8th greedy token differs between the
    # float32 and the Q8_0-rounded weights, so only the right weights pass.
    monkeypatch.setattr(vision_engine_tests, "NEW_TOKENS", 12)
    text, mmproj = write_vl_gguf_pair(served.path, tmp_path, gguf.GGMLQuantizationType.Q8_0)
    # 34 bytes per 32 weights against F32's 128 (both files also hold the vocabulary).
    assert text.stat().st_size < 0.4 * pair[0].stat().st_size
    serve_pair(served, text, mmproj, reference=q8_rounded(served))


def test_mismatched_pairs_are_refused(served: Served, pair: tuple[Path, Path],  # noqa: F811
                                      tmp_path: Path) -> None:
    text, _ = pair
    facts = text_facts(text)
    llava = write_mmproj_gguf(served.path, tmp_path / "mmproj-llava.gguf", projector="mlp")
    with pytest.raises(ValueError, match=re.escape("mmproj-llava.gguf: projector type 'mlp' is "
                                                   "not supported; supported: qwen2.5vl_merger")):
        load_gguf_vision_encoder(llava, facts, CPU, torch.float32)
    wide = write_mmproj_gguf(served.path, tmp_path / "mmproj-wide.gguf",
                             overrides={"clip.vision.projection_dim": 128})
    with pytest.raises(ValueError, match=re.escape(f"mmproj-wide.gguf projects images to 128-wide "
                                                   f"embeddings; {text.name} embeds tokens 64 wide")):
        load_gguf_vision_encoder(wide, facts, CPU, torch.float32)


def test_mmproj_on_a_text_model_is_refused(tmp_path: Path, pair: tuple[Path, Path],
                                           tiny_model_factory) -> None:
    from tests.engine.test_loaders import write_gguf

    text = write_gguf(tiny_model_factory("qwen3"), tmp_path / "qwen3.gguf", "qwen3")
    _, mmproj = pair
    with pytest.raises(ValueError, match=re.escape(f"--mmproj {mmproj.name}: qwen3.gguf is a "
                                                   "Qwen3ForCausalLM model, not a vision-language "
                                                   "GGUF")):
        make_engine(text, vision=True, mmproj=str(mmproj), **SMALL_STEPS)
