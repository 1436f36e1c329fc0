"""engine/loader/gguf_file.py opens GGUF files as gguf.GGUFReader does (the
same metadata, tensor table and tensor bytes), without its seconds per open."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine.loader.gguf_file import GGUFFile, open_gguf
from engine.loader.gguf_weights import GGUFCheckpoint
from protocol.gguf_file import read_gguf_metadata


def assert_matches_gguf_reader(ours: GGUFFile, path: Path) -> None:
    reference = gguf.GGUFReader(path)
    expected = {name: field.contents() for name, field in reference.fields.items()
                if not name.startswith("GGUF.")}
    assert dict(ours.metadata) == expected
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.tensor_type, mine.shape, mine.n_bytes, mine.data_offset) == (
            theirs.tensor_type, tuple(int(n) for n in theirs.shape), int(theirs.n_bytes),
            theirs.data_offset), mine.name
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape)
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name


def test_smollm2_opens_fast_and_as_gguf_reader_reads_it(smollm2_gguf: Path) -> None:
    start = time.perf_counter()
    checkpoint = GGUFCheckpoint(smollm2_gguf)  # gguf.GGUFReader alone took 2.5 s
    assert time.perf_counter() - start < 1.0
    assert checkpoint.config.vocab_size == 49152 and checkpoint.config.num_layers == 30
    assert_matches_gguf_reader(checkpoint.file, smollm2_gguf)
    assert dict(read_gguf_metadata(smollm2_gguf)) == dict(checkpoint.metadata())
    assert checkpoint.file.tensors[0].data.flags.writeable is False  # a view of the file


def _written(path: Path, big_endian: bool) -> Path:
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((4, 64)).astype(np.float32)
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "日本"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25])
    writer.add_uint32("llama.block_count", 1)
    writer.add_tensor("f32", floats)
    writer.add_tensor("f16", floats.astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    writer.add_tensor("vector", floats[0])
    for qtype in (T.BF16, T.Q8_0, T.Q4_0, T.Q5_1):
        writer.add_tensor(qtype.name.lower(), gguf.quants.quantize(floats, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("big_endian", [False, True])
def test_a_written_file_reads_as_gguf_reader_reads_it(tmp_path: Path, big_endian: bool) -> None:
    path = _written(tmp_path / "small.gguf", big_endian)
    ours = open_gguf(path)
    assert_matches_gguf_reader(ours, path)
    by_name = {t.name: t for t in ours.tensors}
    assert by_name["q8_0"].data.shape == (4, 64 // 32 * 34)  # rows of blocks
    assert by_name["f32"].data[1, 2] == np.float32(
        np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)[1, 2])


def test_a_file_cut_inside_its_tensor_data_is_refused(tmp_path: Path) -> None:
    path = _written(tmp_path / "small.gguf", big_endian=False)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="past the end of the file"):
        open_gguf(path)
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        GGUFCheckpoint(path)
