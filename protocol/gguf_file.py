"""Read a GGUF file's header (key-value metadata and tensor table), never its tensor data.

The one GGUF header parser of the project: the router reads model text
(tokenizer, chat template) and mmproj pairs through read_gguf_metadata, the
engine reads configs and tensor tables through read_gguf
(engine/loader/gguf_file.py maps the tensors' bytes). It lives here because
both processes need it and this package is the one both may import; stdlib
only, like the rest of protocol/.

gguf.GGUFReader builds numpy views of every element of every array (SmolLM2's
98 MB file: 2.5 s, mostly its 49k tokens and 49k merges; a 150k-token Qwen
vocabulary: 7 s); this decodes each string once with struct over a memory
map, about 25 ms for SmolLM2, and the pages holding tensor data are never read.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from math import prod
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 counted with 32-bit lengths; no file in use still has it
DEFAULT_ALIGNMENT = 32  # of the tensor data, unless general.alignment says otherwise


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


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table: where a tensor's bytes are, not the bytes."""

    name: str
    dims: tuple[int, ...]  # GGUF order: the innermost (contiguous) dimension first
    type_id: int  # the ggml type (gguf.GGMLQuantizationType's value)
    offset: int  # of its first byte, from the start of the file

    @property
    def n_elements(self) -> int:
        return prod(self.dims)


@dataclass(frozen=True)
class GGUFHeader:
    """Everything before a GGUF file's tensor data."""

    path: Path
    metadata: GGUFMetadata
    tensors: tuple[GGUFTensorInfo, ...]
    big_endian: bool
    data_offset: int  # where the (aligned) tensor data starts


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

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        """(name, dims, ggml type, offset from the start of the data section)."""
        name = self.string()
        n_dims = self.scalar("I")
        if n_dims > 8:  # ggml's GGML_MAX_DIMS is 4; more is a corrupt entry
            raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
        dims = tuple(self.scalars("Q", n_dims))
        return name, dims, self.scalar("I"), self.scalar("Q")


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """Parse the header and key-value pairs of a GGUF file (not its tensor
    table); raise ValueError if it is not one."""
    return _read(Path(path), with_tensors=False).metadata


def read_gguf(path: str | Path) -> GGUFHeader:
    """Parse the metadata and the tensor table of a GGUF file; raise
    ValueError if it is not one (or its tensor table is corrupt)."""
    return _read(Path(path), with_tensors=True)


def _read(path: Path, with_tensors: bool) -> GGUFHeader:
    with open(path, "rb") as file:
        if file.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(path, buf, with_tensors)
            except (struct.error, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: malformed GGUF header ({exc})") from exc


def _parse(path: Path, buf: mmap.mmap, with_tensors: bool) -> GGUFHeader:
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
    metadata = GGUFMetadata(path, version, tensor_count, values)
    if not with_tensors:
        return GGUFHeader(path, metadata, (), endian == ">", 0)
    if tensor_count > len(buf):  # each entry takes more than a byte
        raise ValueError(f"{path}: the header claims {tensor_count} tensors")
    entries = [cursor.tensor_info() for _ in range(tensor_count)]
    alignment = _alignment(path, values)
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = tuple(GGUFTensorInfo(name, dims, type_id, data_offset + offset)
                    for name, dims, type_id, offset in entries)
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError(f"{path}: the tensor table names a tensor twice")
    return GGUFHeader(path, metadata, tensors, endian == ">", data_offset)


def _alignment(path: Path, values: dict[str, Any]) -> int:
    alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
    # A power of two above zero, as llama.cpp and gguf's reader require.
    if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
            or alignment & (alignment - 1)):
        raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
    return alignment
