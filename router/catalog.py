"""The models a router can serve, and the names requests use for them.

A single-model server has one entry. With --models-dir DIR:
- each `*.gguf` directly in DIR is a model named after its file stem;
- each subdirectory holding config.json and *.safetensors (a Hugging Face
  model) or exactly one .gguf is a model named after the subdirectory; a
  .gguf there whose name contains "mmproj" is the model's vision projector,
  used when it is served with --vision (router/mmproj.py).
Anything else is skipped with a log line that says why. A --models-preset
adds models of its own (sections with `model = PATH`) and configures models
of the directory by name (docs/presets.md).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from protocol.vision import VisionSpec, VisionSpecError, read_vision_spec
from router.config import ServeConfig
from router.mmproj import is_mmproj_file, mmproj_beside, read_gguf_vision_spec
from router.options import resolve_settings
from router.presets import Preset, PresetError, PresetSection, load_preset
from router.settings import ModelSettings
from router.text.model_text import ModelText

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    path: Path
    format: str  # "gguf" or "hf"
    settings: ModelSettings = field(default_factory=ModelSettings)
    # A model served with --vision: its image processor settings and image
    # token ids, read once when the catalog is built (with_vision_spec).
    vision: VisionSpec | None = None
    # The mmproj GGUF found beside a GGUF model in its directory, which
    # --vision uses unless --mmproj names another.
    mmproj: Path | None = None


@dataclass(frozen=True)
class Catalog:
    """The models a router serves, by id, and the aliases that name them."""

    entries: dict[str, CatalogEntry]
    aliases: dict[str, str] = field(default_factory=dict)

    def find(self, name: str) -> CatalogEntry | None:
        entry = self.entries.get(name)
        if entry is None and name in self.aliases:
            entry = self.entries[self.aliases[name]]
        return entry


def load_text(entry: CatalogEntry) -> ModelText:
    """The model's text side, with --chat-template and --chat-template-kwargs applied."""
    text = ModelText.load(entry.path)
    settings = entry.settings
    if settings.chat_template is None and settings.chat_template_kwargs == "{}":
        return text
    return text.with_overrides(settings.chat_template, json.loads(settings.chat_template_kwargs))


def with_vision_spec(entry: CatalogEntry) -> CatalogEntry:
    """The entry with its VisionSpec when it is served with --vision. A
    model that cannot take images then stops the server (or the reload) with
    the reason, rather than failing its first image. ValueError."""
    engine = entry.settings.engine
    if not engine.vision:
        return entry
    try:
        if entry.format == "hf":
            if engine.mmproj is not None:
                raise VisionSpecError(f"--mmproj names a GGUF vision projector; {entry.path.name} "
                                      "is a Hugging Face directory, whose tower is its own")
            return replace(entry, vision=read_vision_spec(entry.path))
        mmproj = Path(engine.mmproj) if engine.mmproj is not None else entry.mmproj
        if mmproj is None:
            raise VisionSpecError(f"{entry.path.name} is a GGUF text model: give its vision "
                                  "projector with --mmproj (llama.cpp's mmproj-*.gguf), or put "
                                  "the mmproj file beside it in the model's directory")
        spec = read_gguf_vision_spec(entry.path, mmproj)
    except VisionSpecError as exc:
        raise ValueError(f"model {entry.id!r} is served with --vision, but {exc}") from None
    # The engine reads the projector the router found.
    settings = replace(entry.settings, engine=msgspec.structs.replace(engine, mmproj=str(mmproj)))
    return replace(entry, settings=settings, vision=spec)


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
        ggufs = sorted(p for p in path.glob("*.gguf") if not is_mmproj_file(p))
        if len(ggufs) == 1:
            return CatalogEntry(name or path.name, ggufs[0], "gguf", mmproj=mmproj_beside(path))
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
        if child.is_file() and is_mmproj_file(child):
            log.info("models dir: %s is a vision projector, not a model; put it in its model's "
                     "directory to serve that model with --vision", child.name)
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


def build_catalog(config: ServeConfig) -> Catalog:
    """Every model the configuration serves, with its resolved settings.

    Reads the models directory and the preset afresh on every call and changes
    nothing, so it also serves a reload. Raises ValueError (PresetError for
    anything located in the preset) with a message for the user."""
    if config.model is not None:
        return _single_model_catalog(config)
    if config.aliases:
        raise ValueError("--alias names a single MODEL's aliases; "
                         "in a router give each model's aliases in the preset (alias = a, b)")
    preset = load_preset(config.models_preset) if config.models_preset is not None else None
    found = scan_models_dir(config.models_dir) if config.models_dir is not None else {}
    planned = _plan_entries(found, preset, has_models_dir=config.models_dir is not None)
    entries: dict[str, CatalogEntry] = {}
    for entry, section in planned:
        layers = [
            preset.global_options if preset is not None else {},
            section.values() if section is not None else {},
            dict(config.cli_model_options),
        ]
        settings = _resolve(entry.id, layers, preset, section)
        fresh = CatalogEntry(entry.id, entry.path, entry.format, settings, mmproj=entry.mmproj)
        try:
            entries[entry.id] = with_vision_spec(fresh)
        except ValueError as exc:
            if preset is not None and section is not None:
                raise PresetError(preset.path, section.line, str(exc)) from None
            raise
    if not entries:
        log.warning("the catalog is empty: no models in --models-dir or the preset")
    sections = {entry.id: section for entry, section in planned}
    return Catalog(entries, _alias_table(entries, preset, sections))


def _single_model_catalog(config: ServeConfig) -> Catalog:
    assert config.model is not None
    found = entry_for_path(config.model)
    # A single-model server loads its one model when it starts.
    layers = [dict(config.cli_model_options), {"alias": config.aliases, "load-on-startup": True}]
    entry = with_vision_spec(CatalogEntry(found.id, found.path, found.format,
                                          _resolve(found.id, layers, None, None),
                                          mmproj=found.mmproj))
    return Catalog({entry.id: entry}, _alias_table({entry.id: entry}, None, {}))


def _plan_entries(found: dict[str, CatalogEntry], preset: Preset | None, *, has_models_dir: bool,
                  ) -> list[tuple[CatalogEntry, PresetSection | None]]:
    """Pair every model with its preset section, if it has one."""
    if preset is None:
        return [(entry, None) for entry in found.values()]
    sections = {section.name: section for section in preset.sections}
    planned: list[tuple[CatalogEntry, PresetSection | None]] = [
        (entry, sections.get(model_id)) for model_id, entry in found.items()
        # A section with a path of its own replaces the directory's model of that name.
        if model_id not in sections or sections[model_id].model is None
    ]
    for section in preset.sections:
        if section.model is not None:
            try:
                entry = entry_for_path(preset.model_path(section), section.name)
            except ValueError as exc:
                raise PresetError(preset.path, section.model_line,
                                  f"model [{section.name}]: {exc}") from None
            planned.append((entry, section))
        elif section.name not in found:
            where = "in --models-dir" if has_models_dir else "(no --models-dir given)"
            raise PresetError(preset.path, section.line,
                              f"section [{section.name}] has no 'model = PATH' "
                              f"and names no model {where}")
    return planned


def _resolve(model_id: str, layers: list[dict[str, Any]], preset: Preset | None,
             section: PresetSection | None) -> ModelSettings:
    try:
        return resolve_settings(layers)
    except ValueError as exc:
        reason = f"model {model_id!r}: {exc}"
        # Point at the section that configures the model, as closely as we can.
        if preset is not None and section is not None:
            raise PresetError(preset.path, section.line, reason) from None
        if preset is not None and preset.global_section is not None and preset.global_options:
            raise PresetError(preset.path, preset.global_section.line,
                              f"{reason} (with the options of [*])") from None
        raise ValueError(reason) from None


def _alias_table(entries: dict[str, CatalogEntry], preset: Preset | None,
                 sections: dict[str, PresetSection | None]) -> dict[str, str]:
    """alias -> model id. An alias names one model and is never a model's id."""
    owners: dict[str, str] = {}
    for entry in entries.values():
        for alias in entry.settings.aliases:
            if alias == entry.id:
                clash = "is the model's own id"
            elif alias in entries:
                clash = f"clashes with model {alias!r}"
            elif alias in owners:
                clash = f"is also an alias of model {owners[alias]!r}"
            else:
                owners[alias] = entry.id
                continue
            reason = f"alias {alias!r} of model {entry.id!r} {clash}"
            section = sections.get(entry.id)
            if preset is not None and section is not None and "alias" in section.options:
                raise PresetError(preset.path, section.options["alias"].line, reason)
            raise ValueError(reason)
    return owners
