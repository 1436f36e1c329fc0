"""llama.cpp's GGUF pairs on the router's side: the VisionSpec of a text GGUF
and its mmproj equals the Hugging Face directory's; --models-dir finds an
mmproj beside a model (llama.cpp's convention: a file whose name contains
"mmproj" in the model's subdirectory), --mmproj and the preset key name one;
pairs that do not belong together stop the server with the file and the
reason."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import gguf
import pytest

from protocol.vision import VisionSpec, read_vision_spec
from router.catalog import build_catalog, load_text
from router.cli import parse_serve_command
from router.mmproj import read_gguf_vision_spec
from tests.support.tiny_vl_models import IMAGE_TOKEN
from tests.support.vl_gguf import float32_values, write_mmproj_gguf, write_vl_gguf_pair

ARCHS = ("qwen2_5_vl", "qwen3_vl")
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny VL Hugging Face directory with its image processor config."""
    from tests.engine.test_vision_engine import CLIP_MEAN, CLIP_STD, write_processor_config
    from tests.support.tiny_vl_models import build_tiny_vl_model

    path = tmp_path_factory.mktemp(request.param)
    build_tiny_vl_model(request.param, path)
    write_processor_config(path, PATCH[request.param], CLIP_MEAN, CLIP_STD)
    return path


@pytest.fixture(scope="module")
def pair(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_vl_gguf_pair(checkpoint, tmp_path_factory.mktemp("pair"))


def expected_spec(checkpoint: Path) -> VisionSpec:
    # GGUF stores the mean and std in float32.
    return float32_values(read_vision_spec(checkpoint), "image_mean", "image_std")


def serve(*argv: str):
    return build_catalog(parse_serve_command(["serve", *argv]))


def test_the_pairs_vision_spec_equals_the_checkpoints(checkpoint: Path,
                                                      pair: tuple[Path, Path]) -> None:
    text, mmproj = pair
    assert read_gguf_vision_spec(text, mmproj) == expected_spec(checkpoint)
    catalog = serve(str(text), "--vision", "--mmproj", str(mmproj))
    (entry,) = catalog.entries.values()
    assert entry.vision == expected_spec(checkpoint)
    assert entry.settings.engine.mmproj == str(mmproj)


def test_without_pixel_bounds_the_spec_takes_llama_cpps(checkpoint: Path, pair: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    text, _ = pair
    bare = write_mmproj_gguf(checkpoint, tmp_path / "mmproj-bare.gguf", pixel_bounds=False)
    spec = read_gguf_vision_spec(text, bare)
    token_pixels = (spec.patch_size * 2) ** 2  # llama.cpp's merge size when unsaid is 2, too
    assert (spec.min_pixels, spec.max_pixels) == (8 * token_pixels, 4096 * token_pixels)


def models_dir(root: Path, pair: tuple[Path, Path]) -> Path:
    """root/models/vl/{model-F32.gguf, mmproj-model-F32.gguf}, as llama.cpp's
    router expects a model with a projector."""
    model = root / "models" / "vl"
    model.mkdir(parents=True)
    for file in pair:
        shutil.copy(file, model / file.name)
    return root / "models"


def test_models_dir_finds_the_mmproj_beside_a_model(checkpoint: Path, pair: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    directory = models_dir(tmp_path, pair)
    # An mmproj directly in the directory is nobody's projector and no model.
    shutil.copy(pair[1], directory / "mmproj-stray.gguf")
    catalog = serve("--models-dir", str(directory), "--vision")
    assert list(catalog.entries) == ["vl"]
    entry = catalog.entries["vl"]
    assert entry.path == directory / "vl" / pair[0].name
    assert entry.settings.engine.mmproj == str(directory / "vl" / pair[1].name)
    assert entry.vision == expected_spec(checkpoint)
    # The text side is the text GGUF's: its tokenizer knows the image token.
    assert load_text(entry).encode_prompt("<|image_pad|>") == [IMAGE_TOKEN]
    # Without --vision the projector is found but not used.
    plain = serve("--models-dir", str(directory)).entries["vl"]
    assert plain.mmproj == directory / "vl" / pair[1].name
    assert (plain.vision, plain.settings.engine.mmproj) == (None, None)


def test_the_preset_key_names_the_projector(checkpoint: Path, pair: tuple[Path, Path],
                                            tmp_path: Path) -> None:
    directory = models_dir(tmp_path, pair)
    (tmp_path / "projectors").mkdir()
    other = write_mmproj_gguf(checkpoint, tmp_path / "projectors" / "other.gguf")
    preset = tmp_path / "models.ini"
    preset.write_text("[vl]\nvision = true\nmmproj = projectors/other.gguf\n")
    entry = serve("--models-dir", str(directory), "--models-preset", str(preset)).entries["vl"]
    assert entry.settings.engine.mmproj == str(other)
    assert entry.vision == expected_spec(checkpoint)


def text_only_gguf(path: Path) -> Path:
    """A metadata-only Qwen3 text GGUF (the router reads no tensors)."""
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_embedding_length(64)
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_pairs_that_do_not_belong_together_stop_the_server(checkpoint: Path,
                                                           pair: tuple[Path, Path],
                                                           tmp_path: Path) -> None:
    text, mmproj = pair

    def refused(model: Path, projector: Path, reason: str) -> None:
        with pytest.raises(ValueError, match=re.escape(reason)) as caught:
            serve(str(model), "--vision", "--mmproj", str(projector))
        assert f"model {model.stem!r} is served with --vision, but" in str(caught.value)

    llava = write_mmproj_gguf(checkpoint, tmp_path / "mmproj-llava.gguf", projector="mlp")
    refused(text, llava, "mmproj-llava.gguf: projector type 'mlp' is not supported; "
                         "supported: qwen2.5vl_merger")
    wide = write_mmproj_gguf(checkpoint, tmp_path / "mmproj-wide.gguf",
                             overrides={"clip.vision.projection_dim": 128})
    refused(text, wide, f"mmproj-wide.gguf projects images to 128-wide embeddings; "
                        f"{text.name} embeds tokens 64 wide")
    refused(text_only_gguf(tmp_path / "qwen3.gguf"), mmproj,
            f"--mmproj {mmproj.name}: qwen3.gguf is a 'qwen3' GGUF, not a vision-language model")
    other_family = "qwen3_vl" if "qwen2" in checkpoint.name else "qwen2_5_vl"
    other = write_mmproj_gguf(checkpoint, tmp_path / "mmproj-other.gguf",
                              projector={"qwen3_vl": "qwen3vl_merger",
                                         "qwen2_5_vl": "qwen2.5vl_merger"}[other_family])
    refused(text, other, f"--mmproj mmproj-other.gguf is a {other_family} projector")
    # A Hugging Face directory's tower is its own.
    with pytest.raises(ValueError, match=re.escape("--mmproj names a GGUF vision projector; "
                                                   f"{checkpoint.name} is a Hugging Face "
                                                   "directory")):
        serve(str(checkpoint), "--vision", "--mmproj", str(mmproj))
