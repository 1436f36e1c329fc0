"""Device KV pages as bytes, for saved sessions (engine/kv/slot_files.py).

A page's bytes are laid out as a host tier slot's (engine/execution/host_kv.py):
(layers, k/v, page_size, kv_heads, head_dim), so a session file, a disk tier
page and a host slot hold one page the same way. These copies are synchronous
(a slot save or restore is an explicit, rare call, not on the step path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.execution.device_state import KVCache
from engine.execution.kv_dtype import byte_view


@torch.inference_mode()
def read_pages(kv_caches: Sequence[KVCache], pages: Sequence[int]) -> list[bytes]:
    """The bytes of each device page, in order."""
    if not pages:
        return []
    first = kv_caches[0][0]
    index = torch.tensor(list(pages), dtype=torch.int64, device=first.device)
    stacked = torch.stack([torch.stack([byte_view(cache).index_select(0, index)
                                        for cache in caches], dim=1)
                           for caches in kv_caches], dim=1)  # (pages, layers, 2, ...)
    host = stacked.cpu().contiguous().view(torch.uint8).reshape(len(pages), -1).numpy()
    return [host[i].tobytes() for i in range(len(pages))]


@torch.inference_mode()
def write_pages(kv_caches: Sequence[KVCache], pages: Sequence[int],
                payloads: Sequence[bytes | memoryview]) -> None:
    """Put each payload (one page's bytes) into its device page."""
    if not pages:
        return
    first = kv_caches[0][0]
    shape = (len(kv_caches), 2, *first.shape[1:])
    raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    # An fp8 pool moves as bytes (byte_view): torch has no float8 index_copy_ on the CPU.
    staged = raw.view(byte_view(first).dtype).reshape(len(pages), *shape).to(first.device)
    index = torch.tensor(list(pages), dtype=torch.int64, device=first.device)
    for layer, caches in enumerate(kv_caches):
        for side, cache in enumerate(caches):
            byte_view(cache).index_copy_(0, index, staged[:, layer, side])
    if first.device.type == "cuda":
        torch.cuda.synchronize(first.device)


def page_bytes(kv_caches: Sequence[KVCache]) -> int:
    """Bytes of one page of every layer's K and V."""
    first = kv_caches[0][0]
    return 2 * len(kv_caches) * first[0].numel() * first.element_size()
