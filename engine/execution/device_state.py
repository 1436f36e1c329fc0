"""Host copies of an engine's device state, for sleep and wake.

A sleeping engine gives its device memory back. Its weights go to a host copy
(WeightStash), or are dropped and read from the model file again
(DroppedWeights); the KV pages that the prefix cache keeps go to a host copy
(KVPageStash) and come back into the same page ids, so the KV bookkeeping
(engine/kv/) never notices the sleep.

The tensor objects themselves stay: a freed tensor keeps its device and dtype
with no storage, and the wake gives it storage again. Module attributes, a
tied lm_head (the same Parameter as embed_tokens) and anything else that holds
a parameter see the restored weights without being told.

Each host copy lives in one HostBuffer, a single block of host memory carved
into tensors. On CUDA the block is page-locked with cudaHostRegister rather
than allocated with pin_memory=True: torch's pinned allocator rounds every
block up to a power of two (Qwen3-0.6B's 1.2 GB of weights would take 2 GiB)
and caches freed blocks, so that memory would stay taken after the wake.
Measured on the H200: copies to and from page-locked memory run at 55 GB/s,
to pageable memory at 1.5 GB/s. Page-locking 8 GiB of 4 KiB pages took 0.7
to 1.2 s with the pages touched first (zero_, on all of torch's threads) and
2.7 s without; pin_memory=True took 3.7 s for 8 GB. Huge pages halve that
again (_huge_page_block).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from engine.execution.kv_dtype import byte_view

WeightsMode = Literal["host", "disk"]
KVCache = tuple[torch.Tensor, torch.Tensor]
Layout = Sequence[tuple[torch.Size, torch.dtype]]

# Offsets inside a HostBuffer are multiples of this, so every view is aligned
# for its dtype and for DMA.
_ALIGN = 512


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_device_memory(device: torch.device) -> None:
    """Return freed device memory to the driver, so other processes can use it
    (torch's allocator would otherwise keep it cached for this one)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # cuBLAS keeps a workspace per handle and stream in torch's allocator
        # (32 MiB seen on the H200); the next matrix product makes a new one.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
        # Host-resident experts dropped by a disk sleep (pin_memory=True
        # blocks) would otherwise stay cached by torch's pinned allocator.
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def device_bytes(device: torch.device) -> int:
    """Device memory this process holds through torch (0 on the CPU)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _huge_page_block(nbytes: int) -> torch.Tensor:
    """Anonymous host memory, backed by transparent huge pages where the
    kernel allows it (THP "madvise" or "always"). For 16 GiB on the H200,
    2 MiB pages were faulted in and page-locked in 0.95 s against 2 s for
    4 KiB pages, and unlocked and freed in 0.3 s against 1.2 s."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps the mapping alive; it is unmapped when both are gone.
    return torch.frombuffer(mapping, dtype=torch.uint8)


class HostBuffer:
    """One block of host memory holding tensors of the given shapes and dtypes,
    page-locked when pin is true so device copies are fast and asynchronous."""

    def __init__(self, layout: Layout, *, pin: bool) -> None:
        self._layout = list(layout)
        self._offsets: list[int] = []
        total = 0
        for shape, dtype in self._layout:
            self._offsets.append(total)
            total += -(-shape.numel() * dtype.itemsize // _ALIGN) * _ALIGN
        self.nbytes = total
        self._pinned = False
        if pin and total:
            self._block = _huge_page_block(total)
            # Touching every page first lets torch fault them in with all its
            # threads; registering pages already present is then quicker.
            self._block.zero_()
            cudart = torch.cuda.cudart()
            torch.cuda.check_error(cudart.cudaHostRegister(self._block.data_ptr(), total, 0))
            self._pinned = True
        else:
            self._block = torch.empty(total, dtype=torch.uint8)
        self.tensors = self._views(self._block)

    def _views(self, block: torch.Tensor) -> list[torch.Tensor]:
        return [block[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for offset, (shape, dtype) in zip(self._offsets, self._layout, strict=True)]

    def copy_to(self, device: torch.device) -> list[torch.Tensor]:
        """The tensors, copied to device as views of one allocation laid out
        like this block: one allocation and one transfer instead of one per
        tensor (a fresh allocation after empty_cache() is a cudaMalloc)."""
        block = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        block.copy_(self._block, non_blocking=True)
        return self._views(block)

    def release(self) -> None:
        """Unlock and free the block; every copy from or into it must be done."""
        self.tensors = []
        if self._pinned:
            cudart = torch.cuda.cudart()
            torch.cuda.check_error(cudart.cudaHostUnregister(self._block.data_ptr()))
            self._pinned = False
        self._block = torch.empty(0, dtype=torch.uint8)

    def __del__(self) -> None:
        # A stash dropped without release() (a wake that failed half way)
        # must not leave its pages registered with CUDA once they are
        # unmapped: a later mapping of those addresses would collide with the
        # stale registration (seen on the H200 as "resource already mapped"
        # in the next large allocation).
        if getattr(self, "_pinned", False):
            torch.cuda.synchronize()
            self.release()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of model by name, a tied parameter once."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors


def host_resident_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights that stay in host memory whatever the device (the routed
    experts of host-resident SparseMoE layers, which name them in
    host_weight_names), by their model_tensors name."""
    return {
        f"{prefix}.{name}" if prefix else name: getattr(module, name)
        for prefix, module in model.named_modules()
        for name in getattr(module, "host_weight_names", ())
    }


def device_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """model_tensors less the host-resident ones: what the device holds."""
    host = host_resident_tensors(model)
    return {name: t for name, t in model_tensors(model).items() if name not in host}


def _drop(tensors: Iterable[torch.Tensor]) -> None:
    for tensor in tensors:
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


class WeightStash:
    """A host copy of a model's weights while their device memory is freed.
    Host-resident experts are host memory already: they stay where they are,
    neither copied nor freed."""

    @torch.no_grad()
    def __init__(self, model: nn.Module, *, pin: bool) -> None:
        tensors = device_tensors(model)
        self._names = list(tensors)
        self._buffer = HostBuffer([(t.shape, t.dtype) for t in tensors.values()], pin=pin)
        for host, tensor in zip(self._buffer.tensors, tensors.values(), strict=True):
            host.copy_(tensor, non_blocking=pin)
        # Freed device blocks are reused only after the queued copies (same
        # stream), but the host copy must be complete before anyone trusts it.
        synchronize(next(iter(tensors.values())).device)
        _drop(tensors.values())

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @torch.no_grad()
    def put_back(self, model: nn.Module, device: torch.device) -> None:
        tensors = device_tensors(model)
        # The weights come back as views of one device block; it is freed
        # when the next sleep drops them all.
        for name, restored in zip(self._names, self._buffer.copy_to(device), strict=True):
            tensors[name].data = restored
        synchronize(device)
        self._buffer.release()


class DroppedWeights:
    """A model whose weights were freed, to be refilled from a fresh load of
    the same model file; remembers their shapes to check that load. Its
    host-resident experts go too (their host memory is freed, by
    release_device_memory, and the load reads them again), so the fresh load
    must place its experts as the model did."""

    def __init__(self, model: nn.Module) -> None:
        tensors = model_tensors(model)
        self._layout = {name: (t.shape, t.dtype) for name, t in tensors.items()}
        _drop(tensors.values())

    def put_back(self, model: nn.Module, fresh: nn.Module) -> None:
        """Move fresh's tensors into model's; fresh is left empty."""
        sources = model_tensors(fresh)
        found = {name: (t.shape, t.dtype) for name, t in sources.items()}
        if found != self._layout:
            changed = sorted(n for n in found.keys() | self._layout.keys()
                             if found.get(n) != self._layout.get(n))
            raise ValueError(
                f"the reloaded model does not match the one put to sleep "
                f"({len(changed)} tensors differ, e.g. {', '.join(changed[:3])})"
            )
        targets = model_tensors(model)
        for name, source in sources.items():
            targets[name].data = source.data
        _drop(sources.values())


class KVPageStash:
    """Host copies of some KV pages of every layer, to be put back into the
    same page ids of freshly allocated KV tensors."""

    @torch.no_grad()
    def __init__(self, kv_caches: Sequence[KVCache], pages: Sequence[int], *, pin: bool) -> None:
        self.pages = list(pages)
        first = kv_caches[0][0]
        shape = torch.Size((len(kv_caches), 2, len(self.pages), *first.shape[1:]))
        self._buffer = HostBuffer([(shape, first.dtype)], pin=pin)
        if not self.pages:
            return
        (host,) = self._buffer.tensors
        index = torch.tensor(self.pages, dtype=torch.int64, device=first.device)
        for layer, caches in enumerate(kv_caches):
            for side, cache in enumerate(caches):
                byte_view(host[layer, side]).copy_(byte_view(cache).index_select(0, index),
                                                   non_blocking=pin)
        synchronize(first.device)

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @torch.no_grad()
    def put_back(self, kv_caches: Sequence[KVCache]) -> None:
        if self.pages:
            (host,) = self._buffer.tensors
            device = kv_caches[0][0].device
            index = torch.tensor(self.pages, dtype=torch.int64, device=device)
            for layer, caches in enumerate(kv_caches):
                for side, cache in enumerate(caches):
                    byte_view(cache).index_copy_(
                        0, index, byte_view(host[layer, side]).to(device, non_blocking=True))
            synchronize(device)
        self._buffer.release()


# The files of a model directory whose bytes become the weights (and their shapes).
WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.gguf", "config.json")


@dataclass(frozen=True)
class WeightFiles:
    """Who the weights loaded at start-up were read from, strongly enough to
    tell on wake whether a disk wake would read the same bytes: per file its
    device, inode, size, and modification and status-change times in ns. A
    rewrite in place that keeps the size and puts the old mtime back still
    moves ctime, which no user can set; a replacement by rename changes the
    inode. For a directory, every weight file and the directory itself."""

    stats: tuple[tuple[str, int, int, int, int, int], ...]

    @classmethod
    def of(cls, path: Path) -> WeightFiles:
        files = [path]
        if path.is_dir():
            files += sorted({f for pattern in WEIGHT_FILE_PATTERNS for f in path.glob(pattern)})
        return cls(tuple(_identity(f) for f in files))

    def changed(self) -> list[str]:
        """The files that are no longer what they were (or are gone, or new)."""
        now = WeightFiles.of(Path(self.stats[0][0]))
        before = {s[0]: s for s in self.stats}
        after = {s[0]: s for s in now.stats}
        return sorted(name for name in before.keys() | after.keys()
                      if before.get(name) != after.get(name))


def _identity(path: Path) -> tuple[str, int, int, int, int, int]:
    try:
        st = os.stat(path)  # through symlinks: the bytes that would be read
    except FileNotFoundError:
        return (str(path), -1, -1, -1, -1, -1)
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
