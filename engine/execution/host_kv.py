"""The host tier's memory and the copies between it and the device KV pool.

The pool is one HostBuffer (engine/execution/device_state.py): page-locked on
CUDA, plain memory on the CPU. Each slot holds one page of every layer,
laid out (layers, k/v, page_size, kv_heads, head_dim) in one contiguous run,
so moving a page to or from the host is a single DMA (and a disk tier can
write a slot as one block).

The device's KV tensors are per layer and side, (pages, page_size, kv_heads,
head_dim). A batch of copies goes through a device staging block laid out
like the slots: gathered from (or scattered into) the layers with one
index_select/index_copy_ per layer and side, and moved to (or from) the host
one run of consecutive slots at a time. At most STAGING_BYTES of staging
exist at once (it comes out of the device headroom kv_headroom_mib leaves).

On CUDA the copies run on a side stream. It first waits for the work queued
so far on the compute stream (a page being evicted, or one given out again,
may still be written by the step in flight: a step scheduled before it ended
may still cover a sequence that has stopped); the compute stream then waits
for the copies' event, so the next forward pass, the first that can read a
restored page or overwrite an evicted one, runs after them. The host thread
never waits for them, except to read or write a slot's bytes on the host
(slot_bytes, slot_view), and then only for the last copies that touched
that slot (its fence: the copies' event), not for the whole side stream,
which waits for the step in flight; so the disk tier's reader threads and
its spills never wait a step for a slot no recent copy used. On the CPU the
copies are plain and done on return.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from engine.execution.device_state import HostBuffer, KVCache
from engine.execution.kv_dtype import byte_view
from engine.kv.host_tier import KVTransfers

# Device memory a batch of host-tier copies stages through at most.
STAGING_BYTES = 128 * 2**20


def _chunks(pairs: Sequence[tuple[int, int]], size: int) -> Iterator[Sequence[tuple[int, int]]]:
    for start in range(0, len(pairs), size):
        yield pairs[start : start + size]


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots."""
    start = 0
    for index in range(1, len(slots) + 1):
        if index == len(slots) or slots[index] != slots[index - 1] + 1:
            yield start, slots[start], index - start
            start = index


class HostKVPool:
    """num_slots host pages of every layer's K and V."""

    def __init__(self, num_slots: int, *, num_layers: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.page_shape = torch.Size((num_layers, 2, page_size, num_kv_heads, head_dim))
        pin = device.type == "cuda"
        self._buffer = HostBuffer([(torch.Size((num_slots, *self.page_shape)), dtype)], pin=pin)
        (self.slots,) = self._buffer.tensors
        self.dtype = dtype
        self.page_bytes = self.page_shape.numel() * dtype.itemsize
        self.staging_pages = max(1, STAGING_BYTES // self.page_bytes)
        self._stream = torch.cuda.Stream(device) if pin else None
        # Per slot, the event after the last copies that read or wrote it.
        self._fences: dict[int, torch.cuda.Event] = {}

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @property
    def pinned(self) -> bool:
        return self._stream is not None

    @torch.inference_mode()
    def run(self, transfers: KVTransfers, kv_caches: Sequence[KVCache]) -> None:
        """Queue the copies (stores first, then loads: see KVTransfers) ahead
        of anything queued later on the compute stream."""
        if not transfers:
            return
        if self._stream is None:
            self._copy(transfers, kv_caches)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            # Staging and index tensors are allocated on this stream, so the
            # allocator reuses them only after these copies.
            self._copy(transfers, kv_caches)
            done = torch.cuda.Event()
            done.record(self._stream)
        compute.wait_event(done)
        for _, slot in transfers.stores:
            self._fences[slot] = done
        for slot, _ in transfers.loads:
            self._fences[slot] = done

    def _copy(self, transfers: KVTransfers, kv_caches: Sequence[KVCache]) -> None:
        for chunk in _chunks(transfers.stores, self.staging_pages):
            self._store([page for page, _ in chunk], [slot for _, slot in chunk], kv_caches)
        for chunk in _chunks(transfers.loads, self.staging_pages):
            self._load([slot for slot, _ in chunk], [page for _, page in chunk], kv_caches)

    def _store(self, pages: list[int], slots: list[int], kv_caches: Sequence[KVCache]) -> None:
        staging = torch.empty((len(pages), *self.page_shape), dtype=self.dtype, device=self.device)
        index = torch.tensor(pages, dtype=torch.int64).to(self.device, non_blocking=True)
        # Bytes (byte_view): an fp8 pool moves as is, by ops torch has for uint8.
        staged = byte_view(staging)
        for layer, caches in enumerate(kv_caches):
            for side, cache in enumerate(caches):
                staged[:, layer, side] = byte_view(cache).index_select(0, index)
        for first, slot, count in _runs(slots):
            self.slots[slot : slot + count].copy_(staging[first : first + count], non_blocking=True)

    def _load(self, slots: list[int], pages: list[int], kv_caches: Sequence[KVCache]) -> None:
        staging = torch.empty((len(pages), *self.page_shape), dtype=self.dtype, device=self.device)
        for first, slot, count in _runs(slots):
            staging[first : first + count].copy_(self.slots[slot : slot + count], non_blocking=True)
        index = torch.tensor(pages, dtype=torch.int64).to(self.device, non_blocking=True)
        staged = byte_view(staging)
        for layer, caches in enumerate(kv_caches):
            for side, cache in enumerate(caches):
                byte_view(cache).index_copy_(0, index, staged[:, layer, side])

    def slot_bytes(self, slot: int) -> bytes:
        """A copy of one slot's bytes, once the copies queued into it are
        done (the disk tier writes it while the slot is reused)."""
        self._wait_for(slot)
        return self.slots[slot].view(torch.uint8).numpy().tobytes()

    def slot_view(self, slot: int) -> memoryview:
        """One slot's bytes, writable (a disk tier reader thread reads a page
        into it), once the copies queued from or into it are done; the
        caller sees that none is queued after (the slot is reserved)."""
        self._wait_for(slot)
        return memoryview(self.slots[slot].view(torch.uint8).reshape(-1).numpy())

    def _wait_for(self, slot: int) -> None:
        """Wait for the last copies that touched slot (releases the GIL)."""
        fence = self._fences.get(slot)
        if fence is not None:
            fence.synchronize()

    def synchronize(self) -> None:
        """Wait for every queued copy (before the host reads or frees a slot)."""
        if self._stream is not None:
            self._stream.synchronize()

    def release(self) -> None:
        self.synchronize()
        self._buffer.release()
