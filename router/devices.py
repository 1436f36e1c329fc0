"""The router's view of the GPUs: which there are and how much memory each has
free, read through NVML (libnvidia-ml.so.1) with ctypes, never torch or cupy.

Router device N is CUDA ordinal N as an engine started by this router sees it:
when CUDA_VISIBLE_DEVICES is a list of integers (or of GPU-UUIDs), ordinal N
is the N-th entry of that list, which NVML (which ignores the variable) knows
by another index. The lifecycle's planner (router/lifecycle/seats.py) reads a
`DeviceProbe`; tests hand ModelManager a simulated one instead of NVML.

The standard library only, so the probe can be tried on a GPU host alone.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

NVML_SUCCESS = 0
NVML_LIBRARY = "libnvidia-ml.so.1"
# The install that brings our CUDA kernels (CuPy for torch's CUDA 13).
CUPY_INSTALL = "pip install 'roundhouse[cuda13]' (or '[cuda12]' for CUDA 12)"


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU's memory as the driver reports it now (bytes)."""

    index: int  # the CUDA ordinal engines use (cuda:N)
    name: str
    total_bytes: int
    free_bytes: int

    @property
    def used_bytes(self) -> int:
        return max(self.total_bytes - self.free_bytes, 0)


class DeviceProbe(Protocol):
    """Every GPU engines may use, with its memory now. An empty list: no GPU
    (or no driver): models run on the CPU and are planned by count only."""

    def devices(self) -> list[DeviceMemory]: ...


class NvmlError(RuntimeError):
    pass


class _Memory(ctypes.Structure):
    # nvmlMemory_t (v1): total, free, used, in bytes.
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class NvmlLibrary:
    """The few NVML calls the probe makes, over ctypes. Tests replace it with
    an object that has the same methods."""

    def __init__(self, path: str = NVML_LIBRARY):
        self._lib: Any = ctypes.CDLL(path)
        self._call("nvmlInit_v2")

    def _call(self, name: str, *args: Any) -> None:
        status = getattr(self._lib, name)(*args)
        if status != NVML_SUCCESS:
            raise NvmlError(f"{name} failed with NVML status {status}")

    def count(self) -> int:
        count = ctypes.c_uint(0)
        self._call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        return count.value

    def handle(self, index: int) -> Any:
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        return handle

    def handle_by_uuid(self, uuid: str) -> Any:
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByUUID", ctypes.c_char_p(uuid.encode()),
                   ctypes.byref(handle))
        return handle

    def memory(self, handle: Any) -> tuple[int, int]:
        """(total, free) bytes."""
        info = _Memory()
        self._call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(info))
        return int(info.total), int(info.free)

    def name(self, handle: Any) -> str:
        buffer = ctypes.create_string_buffer(96)
        self._call("nvmlDeviceGetName", handle, buffer, ctypes.c_uint(len(buffer)))
        return buffer.value.decode(errors="replace")


def visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of entries; None when it is unset."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    # CUDA stops at the first entry it cannot parse; an empty entry ends the list.
    entries: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            break
        entries.append(part)
    return entries


class NvmlProbe:
    """The GPUs through NVML. A host without the library (or whose driver
    fails) has no GPUs: said once in the log, then an empty list."""

    def __init__(self, library: Any = None, environ: Mapping[str, str] | None = None):
        self._library = library
        self._environ = os.environ if environ is None else environ
        self._handles: list[tuple[int, Any]] | None = None
        self._failed = False

    def _open(self) -> list[tuple[int, Any]]:
        """(CUDA ordinal, NVML handle) of every GPU an engine can see."""
        if self._handles is not None or self._failed:
            return self._handles or []
        try:
            if self._library is None:
                self._library = NvmlLibrary()
            self._handles = self._map(self._library)
        except (OSError, NvmlError, AttributeError) as exc:
            # AttributeError: a library too old for one of the _v2 entry points.
            self._failed = True
            log.debug("no NVIDIA GPUs found (%s)", exc)
            return []
        return self._handles

    def _map(self, library: Any) -> list[tuple[int, Any]]:
        count = library.count()
        entries = visible_devices(self._environ)
        if entries is None:
            return [(index, library.handle(index)) for index in range(count)]
        handles: list[tuple[int, Any]] = []
        for ordinal, entry in enumerate(entries):
            if entry.isdigit() and int(entry) < count:
                handles.append((ordinal, library.handle(int(entry))))
            elif entry.startswith("GPU-"):
                handles.append((ordinal, library.handle_by_uuid(entry)))
            else:
                # CUDA itself stops at an entry it cannot use; so do we.
                log.warning("CUDA_VISIBLE_DEVICES entry %r names no GPU this host has (or a MIG "
                            "instance, which the memory planner cannot read); planning for the "
                            "%d GPU(s) before it", entry, ordinal)
                break
        return handles

    def devices(self) -> list[DeviceMemory]:
        found: list[DeviceMemory] = []
        for ordinal, handle in self._open():
            try:
                total, free = self._library.memory(handle)
                name = self._library.name(handle)
            except NvmlError as exc:
                log.warning("cannot read GPU %d's memory: %s", ordinal, exc)
                continue
            found.append(DeviceMemory(ordinal, name, total, free))
        return found


def cuda_kernels_installed() -> bool:
    """Whether CuPy (our CUDA kernels' compiler) is installed; found without
    importing it, which would start CUDA in the router."""
    return importlib.util.find_spec("cupy") is not None
