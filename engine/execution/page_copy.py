"""Copies of a page's leading token slots into another page, on the device.

A prompt that matches the first k tokens of a cached page (reuse to the
token: engine/kv/partial_pages.py) gets a fresh page holding a copy of those
k slots of every layer's K and V; the cached page is never written (copy on
write). The copies are plain torch ops queued on the current (compute)
stream after the host tier's copies, so the next forward pass, the first
that reads the fresh page, runs after them, and a page the copies read
cannot have been rewritten before (it is pinned until they are queued).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.execution.device_state import KVCache
from engine.execution.kv_dtype import byte_view
from engine.kv.partial_pages import PageCopy


@torch.inference_mode()
def copy_page_prefixes(copies: Sequence[PageCopy], kv_caches: Sequence[KVCache]) -> None:
    for source, target, num_tokens in copies:
        for caches in kv_caches:
            for cache in caches:
                # Bytes: an fp8 page is copied as is (byte_view).
                raw = byte_view(cache)
                raw[target, :num_tokens].copy_(raw[source, :num_tokens])
