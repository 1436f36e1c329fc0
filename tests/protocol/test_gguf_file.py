"""The project's GGUF header parser (protocol/gguf_file.py) must agree with
the gguf package's reader on every value type, byte order and tensor table.
(tests/engine/test_gguf_file.py compares whole files, SmolLM2's included,
with the tensors' bytes.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from protocol.gguf_file import read_gguf, read_gguf_metadata

VALUES = {
    "t.u8": (200, gguf.GGUFValueType.UINT8), "t.i8": (-100, gguf.GGUFValueType.INT8),
    "t.u16": (60000, gguf.GGUFValueType.UINT16), "t.i16": (-30000, gguf.GGUFValueType.INT16),
    "t.u32": (4_000_000_000, gguf.GGUFValueType.UINT32),
    "t.i32": (-2_000_000_000, gguf.GGUFValueType.INT32),
    "t.u64": (2**63 + 5, gguf.GGUFValueType.UINT64), "t.i64": (-(2**62), gguf.GGUFValueType.INT64),
    "t.f32": (0.5, gguf.GGUFValueType.FLOAT32), "t.f64": (1e-300, gguf.GGUFValueType.FLOAT64),
    "t.bool": (True, gguf.GGUFValueType.BOOL), "t.str": ("héllo ✓", gguf.GGUFValueType.STRING),
}


def write_gguf(path: Path, big_endian: bool = False, alignment: int | None = None,
               tensors: dict[str, np.ndarray] | None = None) -> Path:
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "test", endianess=endian)
    for key, (value, vtype) in VALUES.items():
        writer.add_key_value(key, value, vtype)
    writer.add_array("t.strs", ["a", "", "日本"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, -1.5])
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("big_endian", [False, True])
def test_every_value_type_round_trips(tmp_path: Path, big_endian: bool) -> None:
    meta = read_gguf_metadata(write_gguf(tmp_path / "types.gguf", big_endian))
    assert {key: meta[key] for key in VALUES} == {key: v for key, (v, _) in VALUES.items()}
    assert meta["t.strs"] == ["a", "", "日本"]
    assert meta["t.ints"] == [1, -2, 3]
    assert meta["t.floats"] == [0.25, -1.5]
    assert meta.architecture == "test"


@pytest.mark.parametrize(("big_endian", "alignment"), [(False, None), (True, None), (False, 128)])
def test_the_tensor_table_matches_gguf_reader(tmp_path: Path, big_endian: bool,
                                              alignment: int | None) -> None:
    arrays = {"a.weight": np.arange(15, dtype=np.float32).reshape(3, 5),
              "b.bias": np.ones(7, dtype=np.float16),
              "c.ids": np.arange(24, dtype=np.int32).reshape(2, 3, 4)}
    path = write_gguf(tmp_path / "t.gguf", big_endian, alignment, arrays)
    header = read_gguf(path)
    reference = gguf.GGUFReader(path)
    assert [(t.name, t.dims, t.type_id, t.offset) for t in header.tensors] == [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), t.data_offset)
        for t in reference.tensors]
    assert header.data_offset == reference.data_offset
    assert header.data_offset % (alignment or 32) == 0
    assert header.big_endian == big_endian
    assert header.metadata.tensor_count == 3 and header.tensors[2].n_elements == 24
    # The metadata-only read stops before the table and gives the same values.
    assert dict(read_gguf_metadata(path)) == dict(header.metadata)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_metadata(path)


def test_truncated_file_is_a_value_error(smollm2_gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as source:
        path.write_bytes(source.read(200_000))  # stops inside the token list
    with pytest.raises(ValueError, match=r"malformed|past the end"):
        read_gguf_metadata(path)


def test_a_tensor_named_twice_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "twice.gguf", tensors={"a": np.zeros(4, np.float32),
                                                         "b": np.zeros(4, np.float32)})
    data = path.read_bytes()
    # Rename tensor "b" (its entry: the name's u64 length, then the name) to "a".
    entry = data.index((1).to_bytes(8, "little") + b"b")
    path.write_bytes(data[:entry + 8] + b"a" + data[entry + 9:])
    with pytest.raises(ValueError, match="names a tensor twice"):
        read_gguf(path)


def test_a_bad_alignment_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "align.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_uint32("general.alignment", 48)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="not a power of two"):
        read_gguf(path)
