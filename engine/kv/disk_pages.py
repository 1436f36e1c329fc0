"""One KV page in one file: the disk tier's file format (engine/kv/disk_tier.py).

A file is a fixed header, the page's tokens (uint32 each) and the payload:
one host tier slot, every layer's K and V (engine/execution/host_kv.py). The
header names the KV format and the page hash it was written for and carries a
blake2b checksum of tokens and payload, so a file cut short by a crash, a
flipped bit, or one copied from another model's or format's directory is
recognised and read as a miss, never as K/V of other tokens.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path

MAGIC = b"RHKVPAGE"
VERSION = 1
# magic, version, reserved, KV format digest, page hash, token count,
# payload length, checksum of tokens + payload.
_HEADER = struct.Struct("<8sHH16s16sIQ32s")
CHECKSUM_BYTES = 32


class PageRead(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no such file (evicted, or never written)
    CORRUPT = "corrupt"  # torn, truncated, altered, foreign: never to be read again


def _checksum(token_bytes: bytes, payload: memoryview | bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    digest.update(token_bytes)
    digest.update(payload)
    return digest.digest()


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
