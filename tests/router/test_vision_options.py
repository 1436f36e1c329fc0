"""--vision and --mmproj per model: on the command line, in presets (with
llama.cpp's names), and in the engine's options."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from protocol import EngineOptions
from router.options import add_arguments, given_options, resolve_settings
from router.presets import parse_preset


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(argv)


def test_vision_is_off_unless_asked() -> None:
    assert EngineOptions().vision is False and EngineOptions().mmproj is None
    assert resolve_settings([]).engine.vision is False


def test_the_command_line_sets_vision_and_the_projector(tmp_path: Path) -> None:
    projector = tmp_path / "mmproj-model-f16.gguf"
    projector.write_bytes(b"GGUF")
    given = given_options(parse(["--vision", "--mmproj", str(projector)]))
    assert given == {"vision": True, "mmproj": str(projector)}
    engine = resolve_settings([given]).engine
    assert (engine.vision, engine.mmproj) == (True, str(projector))
    # The engine gets them with the rest of its options.
    assert EngineOptions.from_json(engine.to_json()) == engine
    assert given_options(parse(["--no-vision"])) == {"vision": False}
    with pytest.raises(argparse.ArgumentError, match="does not exist"):
        parse(["--mmproj", str(tmp_path / "missing.gguf")])


def test_a_projector_without_vision_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="add --vision"):
        resolve_settings([{"mmproj": str(tmp_path)}])


def test_preset_keys_with_llamacpp_names(tmp_path: Path) -> None:
    (tmp_path / "proj.gguf").write_bytes(b"GGUF")
    preset = parse_preset("[*]\nvision = true\n[a]\nmmproj = proj.gguf\n[b]\nmm = proj.gguf\n"
                          "[c]\nvision = false\nno-mmproj = true\n", tmp_path / "models.ini")
    assert preset.global_options == {"vision": True}
    a, b, c = preset.sections
    # Relative to the preset's directory, as every path in a preset is.
    assert a.values() == {"mmproj": str(tmp_path / "proj.gguf")}
    assert b.values() == {"mm": str(tmp_path / "proj.gguf")}
    engine = resolve_settings([preset.global_options, b.values()]).engine
    assert (engine.vision, engine.mmproj) == (True, str(tmp_path / "proj.gguf"))
    # llama.cpp's no-mmproj is accepted and ignored: vision is off unless set.
    assert c.values() == {"vision": False}
    assert preset.ignored == (("no-mmproj", 9),)
