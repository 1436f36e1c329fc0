"""Chained 128-bit hashes of full KV pages.

A page's hash covers its parent's hash, its tokens and a fingerprint of the
model and KV format, so equal hashes mean equal K/V contents for everything up
to and including that page. A hit is still confirmed by comparing tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = bytes(16)


def hash_page(parent: bytes, tokens: Sequence[int], fingerprint: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(fingerprint)
    h.update(array("I", tokens).tobytes())
    return h.digest()


def parents_first(links: Sequence[tuple[bytes, bytes]]) -> list[int]:
    """An order of pages, given as (parent hash, hash), in which each comes
    after its parent when that is among them: by their order in links, each
    one's ancestors there first (so the first-listed chains go first)."""
    index = {page_hash: i for i, (_, page_hash) in enumerate(links)}
    placed: set[int] = set()
    order: list[int] = []
    for start in range(len(links)):
        ascent: list[int] = []
        i: int | None = start
        while i is not None and i not in placed:
            placed.add(i)
            ascent.append(i)
            i = index.get(links[i][0])
        order.extend(reversed(ascent))
    return order


def kv_fingerprint(*facts: object) -> bytes:
    """A short digest of whatever makes K/V contents differ (model, dtype, page size)."""
    return hashlib.blake2b(repr(facts).encode(), digest_size=16).digest()
