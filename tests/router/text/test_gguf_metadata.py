"""The metadata-only GGUF reader must agree with the gguf package's reader and stay fast."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from router.text import read_gguf_metadata


def test_smollm2_metadata_matches_gguf_reader(smollm2_gguf: Path) -> None:
    import gguf

    start = time.perf_counter()
    ours = read_gguf_metadata(smollm2_gguf)
    assert time.perf_counter() - start < 1.0
    reference = gguf.GGUFReader(smollm2_gguf)
    expected = {name: field.contents() for name, field in reference.fields.items()
                if not name.startswith("GGUF.")}
    assert dict(ours) == expected
    assert ours.version == 3 and ours.tensor_count == len(reference.tensors)
    assert ours.architecture == "llama" and ours.arch_value("context_length") == 8192
    assert isinstance(ours["tokenizer.ggml.tokens"][5], str)
    assert isinstance(ours["tokenizer.ggml.add_bos_token"], bool)


@pytest.mark.parametrize("big_endian", [False, True])
def test_every_value_type_round_trips(tmp_path: Path, big_endian: bool) -> None:
    import gguf

    path = tmp_path / "types.gguf"
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "test", endianess=endian)
    values = {
        "t.u8": (200, gguf.GGUFValueType.UINT8), "t.i8": (-100, gguf.GGUFValueType.INT8),
        "t.u16": (60000, gguf.GGUFValueType.UINT16), "t.i16": (-30000, gguf.GGUFValueType.INT16),
        "t.u32": (4_000_000_000, gguf.GGUFValueType.UINT32),
        "t.i32": (-2_000_000_000, gguf.GGUFValueType.INT32),
        "t.u64": (2**63 + 5, gguf.GGUFValueType.UINT64), "t.i64": (-(2**62), gguf.GGUFValueType.INT64),
        "t.f32": (0.5, gguf.GGUFValueType.FLOAT32), "t.f64": (1e-300, gguf.GGUFValueType.FLOAT64),
        "t.bool": (True, gguf.GGUFValueType.BOOL), "t.str": ("héllo ✓", gguf.GGUFValueType.STRING),
    }
    for key, (value, vtype) in values.items():
        writer.add_key_value(key, value, vtype)
    writer.add_array("t.strs", ["a", "", "日本"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, -1.5])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    meta = read_gguf_metadata(path)
    assert {key: meta[key] for key in values} == {key: v for key, (v, _) in values.items()}
    assert meta["t.strs"] == ["a", "", "日本"]
    assert meta["t.ints"] == [1, -2, 3]
    assert meta["t.floats"] == [0.25, -1.5]
    assert meta.architecture == "test"


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
