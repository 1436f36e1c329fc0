"""llama.cpp's vision projector files ("mmproj" GGUFs) on the router's side:
finding one beside a model, and reading the VisionSpec of a GGUF pair.

llama.cpp's router (common/preset.cpp load_from_models_dir) looks into each
subdirectory of --models-dir: of its .gguf files, one whose name contains
"mmproj" is the model's projector, the others the model (or its shards).
A .gguf directly in --models-dir is a model of its own, with no projector.
"""

from __future__ import annotations

import logging
from pathlib import Path

from protocol.gguf_file import read_gguf_metadata
from protocol.vision import VisionSpec, VisionSpecError
from protocol.vision_gguf import GGUFTextModel, vision_spec_from_gguf

log = logging.getLogger(__name__)


def is_mmproj_file(path: Path) -> bool:
    """Whether a file is named as llama.cpp names vision projectors."""
    return path.suffix == ".gguf" and "mmproj" in path.name


def mmproj_beside(directory: Path) -> Path | None:
    """The projector in a model's directory, if it holds one (the first by
    name, with a warning, if it holds several)."""
    found = sorted(p for p in directory.glob("*.gguf") if is_mmproj_file(p) and p.is_file())
    if len(found) > 1:
        log.warning("%s holds %d mmproj files (%s); using %s", directory, len(found),
                    ", ".join(p.name for p in found), found[0].name)
    return found[0] if found else None


def read_gguf_vision_spec(model: Path, mmproj: Path) -> VisionSpec:
    """The VisionSpec of a text GGUF and its mmproj; VisionSpecError naming
    the file and the reason when they are not a pair we serve."""
    try:
        text = read_gguf_metadata(model)
        projector = read_gguf_metadata(mmproj)
    except (OSError, ValueError) as exc:
        raise VisionSpecError(str(exc)) from None
    return vision_spec_from_gguf(GGUFTextModel.from_metadata(text, model.name), projector,
                                 mmproj.name)
