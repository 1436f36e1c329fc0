"""A GGUF file opened for loading: its header, parsed by protocol/gguf_file.py
(the project's one GGUF header parser), and each tensor's bytes as a numpy
view of one read-only memory map.

gguf.GGUFReader is not used to open files: it builds a numpy view per element
of the tokenizer arrays, seconds per open (docs/performance.md). The gguf
package still gives what only it knows: the ggml types' block sizes and
dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from protocol.gguf_file import GGUFMetadata, read_gguf

# Types whose elements numpy holds as they are; the others are blocks of bytes.
_NUMPY_TYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, with the fields of gguf.ReaderTensor the loaders read."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost first (numpy's order reversed)
    n_bytes: int
    data_offset: int  # from the start of the file
    # Read-only view of the file: numpy's order, typed for the types numpy
    # holds; for block types, rows of bytes (gguf.quants.dequantize's input).
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: GGUFMetadata
    tensors: tuple[GGUFTensor, ...]


def open_gguf(path: Path) -> GGUFFile:
    """Read the header and map the tensors; ValueError for a file that is not a
    GGUF, has a tensor of an unknown type, or ends before a tensor's bytes do."""
    header = read_gguf(path)
    mapped = np.memmap(path, mode="r")
    # A plain ndarray over the map: slicing a np.memmap costs a Python call per slice.
    raw = np.asarray(mapped)
    tensors = []
    for info in header.tensors:
        try:
            qtype = GGMLQuantizationType(info.type_id)
        except ValueError:
            raise ValueError(f"{path}: tensor {info.name!r} has unknown ggml type "
                             f"{info.type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = info.n_elements * type_size // block_size
        end = info.offset + n_bytes
        if end > raw.size:
            raise ValueError(f"{path}: tensor {info.name!r} ends at byte {end}, past the end "
                             f"of the file ({raw.size} bytes)")
        shape = tuple(reversed(info.dims))
        chunk = raw[info.offset:end]
        if qtype in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[qtype])
            data = chunk.view(dtype.newbyteorder(">") if header.big_endian else dtype)
        else:
            data, shape = chunk, quant_shape_to_byte_shape(shape, qtype)
        tensors.append(GGUFTensor(info.name, qtype, info.dims, n_bytes, info.offset,
                                  data.reshape(shape)))
    return GGUFFile(path, header.metadata, tuple(tensors))
