"""The models a router can serve, and the names requests use for them.

A single-model server has one entry. With --models-dir DIR:
- each `*.gguf` directly in DIR is a model named after its file stem;
- each subdirectory holding config.json and *.safetensors (a Hugging Face
  model) or exactly one .gguf is a model named after the subdirectory.
Anything else is skipped with a log line that says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    path: Path
    format: str  # "gguf" or "hf"


def entry_for_path(path: Path, name: str | None = None) -> CatalogEntry:
    """Describe one model artifact; ValueError when it isn't one."""
    path = path.expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a .gguf file")
        return CatalogEntry(name or path.stem, path, "gguf")
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return CatalogEntry(name or path.name, path, "hf")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return CatalogEntry(name or path.name, ggufs[0], "gguf")
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds {len(ggufs)} .gguf files; a model directory needs exactly one")
        raise ValueError(f"{path} has neither config.json with *.safetensors nor a .gguf file")
    raise ValueError(f"{path} does not exist")


def scan_models_dir(directory: Path) -> dict[str, CatalogEntry]:
    if not directory.is_dir():
        raise ValueError(f"--models-dir {directory} is not a directory")
    entries: dict[str, CatalogEntry] = {}
    for child in sorted(directory.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_file() and child.suffix != ".gguf":
            continue
        try:
            entry = entry_for_path(child)
        except ValueError as exc:
            log.warning("models dir: skipping %s: %s", child.name, exc)
            continue
        if entry.id in entries:
            log.warning("models dir: %s and %s both name model %r; keeping the first",
                        entries[entry.id].path, entry.path, entry.id)
            continue
        entries[entry.id] = entry
    log.info("models dir %s: %d models (%s)", directory, len(entries), ", ".join(entries) or "none")
    return entries
