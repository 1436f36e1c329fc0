"""One KV page in one file: the disk tier's file format (engine/kv/disk_tier.py).

A file is a fixed header, the page's tokens (uint32 each) and the payload:
one host tier slot, every layer's K and V (engine/execution/host_kv.py). The
header names the KV format and the page hash it was written for and carries a
CRC-32 of tokens and payload, so a file cut short by a crash, a flipped bit,
or one copied from another model's or format's directory is recognised and
read as a miss, never as K/V of other tokens.

Why CRC-32 and not a cryptographic digest: the checksum guards against
accidents (torn writes, bad sectors), not an adversary with write access to
the directory, and the header's format digest, page hash and the token
comparison catch a foreign file first. CRC-32 catches every error burst up
to 32 bits and misses random damage with probability 2^-32; it runs at
4-5 GB/s a core (zlib, releasing the GIL) where BLAKE2b ran at 0.5-0.9 GB/s
and bound the tier's writers and readers (docs/performance.md).
"""

from __future__ import annotations

import enum
import struct
import zlib
from array import array
from collections.abc import Sequence
from pathlib import Path

MAGIC = b"RHKVPAGE"
# 2: CRC-32 in place of version 1's BLAKE2b (version 1 files read as corrupt).
VERSION = 2
# magic, version, reserved, KV format digest, page hash, token count,
# payload length, CRC-32 of tokens + payload.
_HEADER = struct.Struct("<8sHH16s16sIQI")


class PageRead(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no such file (evicted, or never written)
    CORRUPT = "corrupt"  # torn, truncated, altered, foreign: never to be read again


def _checksum(token_bytes: bytes, payload: memoryview | bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(token_bytes))


def page_header(format_digest: bytes, page_hash: bytes, tokens: Sequence[int],
                payload: memoryview | bytes) -> bytes:
    """Everything a page file holds before its payload."""
    token_bytes = array("I", tokens).tobytes()
    header = _HEADER.pack(MAGIC, VERSION, 0, format_digest, page_hash, len(tokens),
                          len(payload), _checksum(token_bytes, payload))
    return header + token_bytes


def file_bytes(num_tokens: int, payload_bytes: int) -> int:
    """The size of a page file."""
    return _HEADER.size + 4 * num_tokens + payload_bytes


def read_page(path: Path, format_digest: bytes, page_hash: bytes, tokens: Sequence[int],
              into: memoryview) -> PageRead:
    """Read the page file at path into `into` (exactly the payload's size),
    checking everything the header promises. On anything but OK, `into`
    holds garbage. A file that vanishes while read reads as MISSING."""
    try:
        with open(path, "rb") as file:
            head = file.read(_HEADER.size)
            if len(head) != _HEADER.size:
                return PageRead.CORRUPT
            (magic, version, _, fmt, hashed, num_tokens, payload_len,
             checksum) = _HEADER.unpack(head)
            if (magic != MAGIC or version != VERSION or fmt != format_digest
                    or hashed != page_hash or num_tokens != len(tokens)
                    or payload_len != into.nbytes):
                return PageRead.CORRUPT
            token_bytes = file.read(4 * num_tokens)
            if len(token_bytes) != 4 * num_tokens:
                return PageRead.CORRUPT
            if file.readinto(into) != payload_len or file.read(1):
                return PageRead.CORRUPT  # truncated, or longer than it says
    except FileNotFoundError:
        return PageRead.MISSING
    if checksum != _checksum(token_bytes, into):
        return PageRead.CORRUPT
    # The hash matched; the tokens are still compared, as a device hit's are.
    if array("I", token_bytes).tolist() != list(tokens):
        return PageRead.CORRUPT
    return PageRead.OK
