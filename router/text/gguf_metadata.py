"""Read a GGUF file's key-value metadata without touching its tensor data.

gguf.GGUFReader builds numpy views of every field and every tensor, which
takes about 1.6 s on SmolLM2's 98 MB file (mostly its 100k tokenizer strings);
the router only needs the key-value section, so this parses just that from a
memory map, and the pages holding tensor data are never read.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping
from enum import IntEnum
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 counted with 32-bit lengths; no file in use still has it


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_CODES = {
    ValueType.UINT8: "B", ValueType.INT8: "b", ValueType.UINT16: "H", ValueType.INT16: "h",
    ValueType.UINT32: "I", ValueType.INT32: "i", ValueType.FLOAT32: "f", ValueType.BOOL: "?",
    ValueType.UINT64: "Q", ValueType.INT64: "q", ValueType.FLOAT64: "d",
}


class GGUFMetadata(Mapping[str, Any]):
    """The key-value section of a GGUF file, as plain Python values (str, int, float, bool, list)."""

    def __init__(self, path: Path, version: int, tensor_count: int, values: dict[str, Any]) -> None:
        self.path = path
        self.version = version
        self.tensor_count = tensor_count
        self._values = values

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def architecture(self) -> str | None:
        return self._values.get("general.architecture")

    def arch_value(self, suffix: str) -> Any:
        """The `{architecture}.{suffix}` value (e.g. "context_length"), or None."""
        arch = self.architecture
        return None if arch is None else self._values.get(f"{arch}.{suffix}")


class _Cursor:
    """Sequential little- or big-endian reads over a buffer, with bounds checks."""

    def __init__(self, buf: mmap.mmap, endian: str) -> None:
        self.buf = buf
        self.pos = 0
        self.endian = endian
        self._u64 = struct.Struct(endian + "Q")

    def scalar(self, code: str) -> Any:
        fmt = struct.Struct(self.endian + code)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self) -> str:
        (length,) = self._u64.unpack_from(self.buf, self.pos)
        start = self.pos + 8
        end = start + length
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos = end
        return self.buf[start:end].decode("utf-8")

    def strings(self, count: int) -> list[str]:
        # The hot loop: 100k+ tokenizer strings, so keep lookups local.
        buf, unpack, pos, size = self.buf, self._u64.unpack_from, self.pos, len(self.buf)
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (length,) = unpack(buf, pos)
            pos += 8
            end = pos + length
            if end > size:
                raise ValueError("a string runs past the end of the file")
            append(buf[pos:end].decode("utf-8"))
            pos = end
        self.pos = pos
        return out

    def scalars(self, code: str, count: int) -> list[Any]:
        fmt = struct.Struct(f"{self.endian}{count}{code}")
        values = list(fmt.unpack_from(self.buf, self.pos))
        self.pos += fmt.size
        return values

    def value(self, vtype: int) -> Any:
        if vtype == ValueType.STRING:
            return self.string()
        if vtype == ValueType.ARRAY:
            item_type = self.scalar("I")
            count = self.scalar("Q")
            if count > len(self.buf):  # each item takes at least a byte
                raise ValueError(f"an array claims {count} items, more than the file holds")
            if item_type == ValueType.STRING:
                return self.strings(count)
            if item_type in _SCALAR_CODES:
                return self.scalars(_SCALAR_CODES[ValueType(item_type)], count)
            if item_type == ValueType.ARRAY:
                return [self.value(ValueType.ARRAY) for _ in range(count)]
            raise ValueError(f"unknown GGUF array item type {item_type}")
        if vtype in _SCALAR_CODES:
            return self.scalar(_SCALAR_CODES[ValueType(vtype)])
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """Parse the header and key-value pairs of a GGUF file; raise ValueError if it is not one."""
    path = Path(path)
    with open(path, "rb") as file:
        if file.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(path, buf)
            except (struct.error, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: malformed GGUF metadata ({exc})") from exc


def _parse(path: Path, buf: mmap.mmap) -> GGUFMetadata:
    (raw_version,) = struct.unpack_from("<I", buf, 4)
    # A big-endian file (s390x builds) stores the version byte-swapped, so the
    # small version number lands in the high bytes when read little-endian.
    endian = "<" if raw_version & 0xFFFF else ">"
    cursor = _Cursor(buf, endian)
    cursor.pos = 4
    version = cursor.scalar("I")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
    tensor_count = cursor.scalar("Q")
    kv_count = cursor.scalar("Q")
    values: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        vtype = cursor.scalar("I")
        try:
            values[key] = cursor.value(vtype)
        except ValueError as exc:
            raise ValueError(f"{path}: key {key!r}: {exc}") from exc
    return GGUFMetadata(path, version, tensor_count, values)
