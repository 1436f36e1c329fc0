"""A saved session (llama.cpp's POST /slots/{id}?action=save): one file.

A file is a fixed header, the session's tokens (uint32 each), the K/V of its
full pages (each in a host tier slot's layout, engine/execution/host_kv.py,
as the disk tier's page files hold it) and a BLAKE2b checksum of everything
before it. The header names the model artifact and the KV format with the
digests the disk tier uses (engine/kv/disk_tier.py artifact_digest,
format_digest), so a file of another model or format is refused by name,
and one that is torn or altered fails its checksum: both before anything is
allocated for it.

Tokens past the last full page have no K/V in the file: a request that
continues the session computes them (at most page_size - 1 tokens). So can
pages the caches no longer held at save time: the file keeps the run of full
pages from the start that the device or host tier still had (num_pages).

Written to a temporary name in the same directory, then renamed, so a
reader never sees half a file. No torch here.
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"RHKVSLOT"
VERSION = 1
# magic, version, reserved, model artifact digest, KV format digest,
# page size, token count, pages with K/V, bytes per page.
_HEADER = struct.Struct("<8sHH16s16sIIIQ")
CHECKSUM_BYTES = 32


class SlotFileError(ValueError):
    """A slot file that cannot be restored; the message says why."""


@dataclass(frozen=True)
class SlotFile:
    token_ids: list[int]
    page_size: int
    page_bytes: int
    # K/V of the first len(pages) full pages of token_ids.
    pages: list[memoryview]
    num_bytes: int


def write_slot_file(path: Path, *, model_digest: bytes, format_digest: bytes, page_size: int,
                    page_bytes: int, token_ids: Sequence[int], pages: Iterable[bytes]) -> int:
    """Write the file (temporary name + rename); returns its size in bytes."""
    payloads = list(pages)
    if any(len(payload) != page_bytes for payload in payloads):
        raise ValueError("every page's K/V must be page_bytes long")
    if len(payloads) * page_size > len(token_ids):
        raise ValueError("more pages than the tokens fill")
    checksum = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    size = 0
    try:
        with open(temporary, "wb") as file:
            for part in (_HEADER.pack(MAGIC, VERSION, 0, model_digest, format_digest, page_size,
                                      len(token_ids), len(payloads), page_bytes),
                         array("I", token_ids).tobytes(), *payloads):
                checksum.update(part)
                file.write(part)
                size += len(part)
            file.write(checksum.digest())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return size + CHECKSUM_BYTES


def read_slot_file(path: Path, *, model_digest: bytes, format_digest: bytes, page_size: int,
                   page_bytes: int) -> SlotFile:
    """Read and check a whole file; SlotFileError names what is wrong."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SlotFileError(f"slot file {path.name!r} does not exist") from None
    except OSError as exc:
        raise SlotFileError(f"slot file {path.name!r} cannot be read: {exc.strerror}") from None
    name = repr(path.name)
    if len(data) < _HEADER.size + CHECKSUM_BYTES or not data.startswith(MAGIC):
        raise SlotFileError(f"slot file {name} is not a Roundhouse slot file (or is truncated)")
    (_, version, _, model, kv_format, file_page_size, num_tokens, num_pages,
     file_page_bytes) = _HEADER.unpack_from(data)
    if version != VERSION:
        raise SlotFileError(f"slot file {name} has format version {version}; this server "
                            f"reads version {VERSION}")
    if model != model_digest:
        raise SlotFileError(f"slot file {name} was saved by another model (or another copy "
                            "of its files); it cannot be restored into this one")
    if (kv_format != format_digest or file_page_size != page_size
            or file_page_bytes != page_bytes):
        raise SlotFileError(f"slot file {name} was saved with another KV format (dtype, page "
                            "size or shape); it cannot be restored with this one")
    body = _HEADER.size + 4 * num_tokens + num_pages * page_bytes
    if len(data) != body + CHECKSUM_BYTES:
        raise SlotFileError(f"slot file {name} is truncated or has trailing bytes "
                            f"({len(data)} bytes, its header says {body + CHECKSUM_BYTES})")
    view = memoryview(data)
    if hashlib.blake2b(view[:body], digest_size=CHECKSUM_BYTES).digest() != data[body:]:
        raise SlotFileError(f"slot file {name} is damaged: its checksum does not match")
    if num_pages * page_size > num_tokens:
        raise SlotFileError(f"slot file {name} is inconsistent: more pages than tokens")
    start = _HEADER.size + 4 * num_tokens
    tokens = array("I")
    tokens.frombytes(data[_HEADER.size : start])
    pages = [view[start + i * page_bytes : start + (i + 1) * page_bytes]
             for i in range(num_pages)]
    return SlotFile(tokens.tolist(), page_size, page_bytes, pages, len(data))
