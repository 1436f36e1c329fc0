"""llama.cpp-format model presets (`--models-preset FILE`).

    version = 1              ; optional, before any section
    [*]                      ; options for every model
    max-concurrency = 4
    [qwen3-8b]               ; a --models-dir model, configured by name
    temp = 0.6
    [coder]                  ; a model of the preset's own
    model = ../models/coder.gguf
    alias = code, c

Written by hand rather than with configparser: every error must carry its
line number, and configparser accepts what llama.cpp refuses (keys before a
section, continuation lines, `:` separators, inline interpolation).
Comments take a whole line, starting with `;` or `#`.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from router.llamacpp_preset_keys import UNUSED_LLAMA_CPP_KEYS
from router.options import BY_NAME, ROUTER_OPTIONS, OptionValueError, is_inline_template

log = logging.getLogger(__name__)

GLOBAL_SECTION = "*"
PRESET_VERSION = 1

_SECTION = re.compile(r"\[([^\[\]]*)\]")
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# llama.cpp's names for options Roundhouse spells differently: a hint for
# presets brought over from llama-server.
_LLAMA_CPP_NAMES = {
    "ctx-size": "max-context", "c": "max-context",
    "parallel": "max-concurrency", "np": "max-concurrency",
    "batch-size": "max-batched-tokens", "b": "max-batched-tokens",
    "t": "threads", "s": "seed", "temperature": "temp", "cram": "cache-ram",
}


class PresetError(ValueError):
    """A preset that cannot be used; str() is `file:line: reason`."""

    def __init__(self, path: Path, line: int | None, reason: str):
        self.path = path
        self.line = line
        self.reason = reason
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else f"{self.path}"
        return f"{where}: {self.reason}"


@dataclass(frozen=True)
class PresetValue:
    value: Any
    line: int


@dataclass(frozen=True)
class PresetSection:
    name: str
    line: int
    # Per-model options by name, parsed, with the line that set each.
    options: Mapping[str, PresetValue] = field(default_factory=dict)
    # `model = PATH` as written; relative to the preset's directory.
    model: str | None = None
    model_line: int | None = None

    def values(self) -> dict[str, Any]:
        """The options as a layer for router.options.resolve_settings."""
        return {name: item.value for name, item in self.options.items()}

    @property
    def aliases(self) -> tuple[str, ...]:
        item = self.options.get("alias")
        return item.value if item is not None else ()

    @property
    def load_on_startup(self) -> bool:
        item = self.options.get("load-on-startup")
        return bool(item.value) if item is not None else False


@dataclass(frozen=True)
class Preset:
    path: Path
    version: int | None = None
    # The [*] section, if the file has one.
    global_section: PresetSection | None = None
    # Model sections in file order; names are unique.
    sections: tuple[PresetSection, ...] = ()
    # llama.cpp options Roundhouse does not use, with the line of each: accepted
    # and named in one warning when the preset is loaded.
    ignored: tuple[tuple[str, int], ...] = ()

    @property
    def global_options(self) -> dict[str, Any]:
        return self.global_section.values() if self.global_section is not None else {}

    def section(self, name: str) -> PresetSection | None:
        return next((s for s in self.sections if s.name == name), None)

    def model_path(self, section: PresetSection) -> Path:
        """A section's `model = PATH`, relative paths taken from the preset's directory."""
        if section.model is None:
            raise ValueError(f"section [{section.name}] gives no model path")
        path = Path(section.model).expanduser()
        return path if path.is_absolute() else self.path.absolute().parent / path


def load_preset(path: Path) -> Preset:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PresetError(path, None, f"cannot read the preset: {exc}") from None
    preset = parse_preset(text, path)
    if preset.ignored:
        listed = ", ".join(f"{key} (line {line})" for key, line in preset.ignored)
        log.warning("preset %s: ignoring llama.cpp options Roundhouse does not use: %s",
                    path, listed)
    return preset


def parse_preset(text: str, path: Path) -> Preset:
    return _Parser(path).parse(text)


@dataclass
class _OpenSection:
    name: str
    line: int
    options: dict[str, PresetValue] = field(default_factory=dict)
    model: str | None = None
    model_line: int | None = None
    # Every key's first line, for duplicate-key errors (model included).
    keys: dict[str, int] = field(default_factory=dict)

    def close(self) -> PresetSection:
        return PresetSection(self.name, self.line, dict(self.options), self.model, self.model_line)


class _Parser:
    def __init__(self, path: Path):
        self.path = path
        self.version: int | None = None
        self.version_line = 0
        self.sections: dict[str, _OpenSection] = {}
        self.current: _OpenSection | None = None
        self.ignored: list[tuple[str, int]] = []

    def parse(self, text: str) -> Preset:
        for number, raw in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
            line = raw.strip()
            if not line or line[0] in ";#":
                continue
            if line.startswith("["):
                self._open_section(line, number)
            elif "=" in line:
                key, _, value = line.partition("=")
                self._key_value(key.strip(), value.strip(), number)
            else:
                self._fail(number, f"expected [section], key = value or a comment, got {line!r}")
        closed = {name: section.close() for name, section in self.sections.items()}
        return Preset(
            path=self.path,
            version=self.version,
            global_section=closed.pop(GLOBAL_SECTION, None),
            sections=tuple(closed.values()),
            ignored=tuple(self.ignored),
        )

    def _fail(self, line: int, reason: str) -> NoReturn:
        raise PresetError(self.path, line, reason)

    def _open_section(self, line: str, number: int) -> None:
        match = _SECTION.fullmatch(line)
        if match is None:
            self._fail(number, f"malformed section header {line!r}")
        name = match.group(1).strip()
        if not name:
            self._fail(number, "empty section name []")
        if name in self.sections:
            self._fail(number, f"duplicate section [{name}] (first on line {self.sections[name].line})")
        self.current = self.sections[name] = _OpenSection(name, number)

    def _key_value(self, key: str, value: str, number: int) -> None:
        if not _KEY.fullmatch(key):
            hint = f"; write {key.lstrip('-')!r}, without dashes" if key.startswith("-") else ""
            self._fail(number, f"malformed key {key!r}{hint}")
        section = self.current
        if section is None:
            self._top_level(key, value, number)
            return
        if key in section.keys:
            self._fail(number, f"duplicate key {key!r} in [{section.name}] "
                               f"(first on line {section.keys[key]})")
        section.keys[key] = number
        per_model = key == "model" or (key in BY_NAME and BY_NAME[key].section_only)
        if per_model and section.name == GLOBAL_SECTION:
            self._fail(number, f"{key!r} is set per model; it cannot go in [*]")
        if key == "model":
            if not value:
                self._fail(number, "'model' needs a path")
            section.model, section.model_line = value, number
            return
        option = BY_NAME.get(key)
        if option is None and key in UNUSED_LLAMA_CPP_KEYS and key not in ROUTER_OPTIONS:
            self.ignored.append((key, number))
            return
        if option is None:
            self._fail(number, self._unknown(key))
        if (option.is_path and value and not is_inline_template(value)
                and not Path(value).expanduser().is_absolute()):
            # As for `model = PATH`: relative to the preset, wherever the server runs.
            value = str(self.path.absolute().parent / value)
        try:
            parsed = option.parse(value)
        except OptionValueError as exc:
            self._fail(number, f"option {key!r}: {exc}")
        section.options[key] = PresetValue(parsed, number)

    def _top_level(self, key: str, value: str, number: int) -> None:
        if key != "version":
            self._fail(number, f"option {key!r} comes before any [section]; "
                               "put it under [*] to apply it to every model")
        if self.version is not None:
            self._fail(number, f"duplicate key 'version' (first on line {self.version_line})")
        if value != str(PRESET_VERSION):
            self._fail(number, f"unsupported preset version {value!r} (this server reads version 1)")
        self.version, self.version_line = PRESET_VERSION, number

    @staticmethod
    def _unknown(key: str) -> str:
        if key in ROUTER_OPTIONS:
            return f"option {key!r} applies to the whole router; give it on the command line"
        if key == "version":
            return "'version' goes at the top of the file, before any section"
        reason = f"unknown option {key!r}"
        known = [*BY_NAME, "model", *UNUSED_LLAMA_CPP_KEYS]
        suggestion = _LLAMA_CPP_NAMES.get(key) or next(
            iter(difflib.get_close_matches(key, known, n=1, cutoff=0.6)), None)
        if suggestion in UNUSED_LLAMA_CPP_KEYS:
            return f"{reason} (did you mean {suggestion!r}, a llama.cpp option Roundhouse ignores?)"
        return f"{reason} (did you mean {suggestion!r}?)" if suggestion else reason
