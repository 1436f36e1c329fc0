"""The NVML probe's view of the GPUs (router/devices.py) with a stand-in
library: CUDA_VISIBLE_DEVICES decides which NVML device is CUDA ordinal N."""

from __future__ import annotations

from typing import Any

import pytest

from router.devices import DeviceMemory, NvmlError, NvmlProbe, visible_devices

GIB = 2**30


class FakeNvml:
    """NVML's view: devices by NVML index, each with a UUID."""

    def __init__(self, count: int):
        self.total = [(index + 1) * 10 * GIB for index in range(count)]
        self.free = [(index + 1) * GIB for index in range(count)]
        self.calls = 0

    def count(self) -> int:
        return len(self.total)

    def handle(self, index: int) -> Any:
        if not 0 <= index < len(self.total):
            raise NvmlError("nvmlDeviceGetHandleByIndex_v2 failed with NVML status 2")
        return index

    def handle_by_uuid(self, uuid: str) -> Any:
        return int(uuid.removeprefix("GPU-fake-"))

    def memory(self, handle: Any) -> tuple[int, int]:
        self.calls += 1
        return self.total[handle], self.free[handle]

    def name(self, handle: Any) -> str:
        return f"Fake GPU {handle}"


def probe(count: int, environ: dict[str, str]) -> list[DeviceMemory]:
    return NvmlProbe(FakeNvml(count), environ).devices()


def test_without_cuda_visible_devices_every_gpu_in_nvml_order() -> None:
    assert [(d.index, d.name) for d in probe(3, {})] == [
        (0, "Fake GPU 0"), (1, "Fake GPU 1"), (2, "Fake GPU 2")]


def test_cuda_visible_devices_renumbers_the_gpus() -> None:
    found = probe(4, {"CUDA_VISIBLE_DEVICES": "2,0"})
    # CUDA ordinal 0 is NVML device 2, ordinal 1 is NVML device 0.
    assert [(d.index, d.name, d.total_bytes) for d in found] == [
        (0, "Fake GPU 2", 30 * GIB), (1, "Fake GPU 0", 10 * GIB)]
    assert found[0].used_bytes == 27 * GIB


def test_uuids_and_the_end_of_the_list() -> None:
    assert [d.name for d in probe(4, {"CUDA_VISIBLE_DEVICES": "GPU-fake-3,1"})] == [
        "Fake GPU 3", "Fake GPU 1"]
    # CUDA stops at an entry it cannot use (here a GPU the host lacks), and at an empty one.
    assert [d.name for d in probe(2, {"CUDA_VISIBLE_DEVICES": "1,5,0"})] == ["Fake GPU 1"]
    assert [d.name for d in probe(2, {"CUDA_VISIBLE_DEVICES": "0,,1"})] == ["Fake GPU 0"]
    assert probe(2, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert probe(2, {"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_visible_devices_parsing() -> None:
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": " 1, 0 "}) == ["1", "0"]


def test_a_host_without_the_library_has_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import router.devices as devices

    def missing(path: str = "") -> Any:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(devices, "NvmlLibrary", missing)
    nvml = NvmlProbe(environ={})
    assert nvml.devices() == [] and nvml.devices() == []


def test_memory_is_read_afresh_on_every_probe() -> None:
    library = FakeNvml(1)
    nvml = NvmlProbe(library, {})
    assert nvml.devices()[0].free_bytes == GIB
    library.free[0] = 5 * GIB
    assert nvml.devices()[0].free_bytes == 5 * GIB
