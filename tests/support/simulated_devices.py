"""Simulated GPUs for the device-memory planner: a DeviceProbe
(router/devices.py) whose used memory is what other processes hold plus what
stand-in engines say they hold. Hand it to ModelManager(probe=...)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.devices import DeviceMemory

GIB = 2**30


class OutOfMemory(RuntimeError):
    """A stand-in engine asked for more than its simulated GPU has free."""


@dataclass
class SimulatedDevices:
    totals: list[int]
    # Bytes held by processes that are not ours, per GPU.
    other: dict[int, int] = field(default_factory=dict)
    # Bytes each stand-in engine holds, by (GPU, holder name).
    held: dict[tuple[int, str], int] = field(default_factory=dict)
    probes: int = 0

    def devices(self) -> list[DeviceMemory]:
        self.probes += 1
        return [DeviceMemory(index, "Simulated GPU", total, self.free(index))
                for index, total in enumerate(self.totals)]

    def free(self, gpu: int) -> int:
        used = self.other.get(gpu, 0) + sum(b for (g, _), b in self.held.items() if g == gpu)
        return self.totals[gpu] - used

    def hold(self, gpu: int, name: str, size: int) -> None:
        """What a real engine's allocation does: fail beyond the free memory."""
        if size > self.free(gpu):
            raise OutOfMemory(f"CUDA out of memory: {name} asked for {size} bytes on GPU {gpu}, "
                              f"{self.free(gpu)} free")
        self.held[(gpu, name)] = size

    def drop(self, gpu: int, name: str) -> None:
        self.held.pop((gpu, name), None)


class NoDevices:
    """A host without GPUs."""

    def devices(self) -> list[DeviceMemory]:
        return []
