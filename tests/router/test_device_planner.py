"""The device-memory planner (SeatArbiter + DeviceNeeds) driven through the
real ModelManager and ModelLifecycle, with stand-in engines that hold what
they were granted on simulated GPUs (and fail the way CUDA does when they
ask for more than is free)."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from protocol import (
    EngineOptions,
    MemoryFacts,
    Ready,
)
from router.catalog import Catalog, CatalogEntry
from router.config import ServeConfig
from router.errors import Unavailable
from router.footprint import CUDA_CONTEXT_BYTES, estimate_footprint, read_shape
from router.lifecycle.manager import ModelManager
from router.lifecycle.slot import ModelState
from router.observability.records import Observers
from router.settings import ModelSettings
from tests.support.fake_engines import FakeEngine, use_fake_engines
from tests.support.simulated_devices import NoDevices, OutOfMemory, SimulatedDevices

S = ModelState
MIB = 2**20
GIB = 2**30
HEADROOM_MIB = 256
# The share of its grant a stand-in engine really holds (a real one sizes its
# KV pool to what its lanes use, within the grant).
USE = 0.9


class GpuEngine(FakeEngine):
    """A stand-in engine that holds what it was granted on simulated GPUs,
    and fails the way CUDA does when it asks for more than is free."""

    devices: ClassVar[SimulatedDevices | None] = None
    launched: ClassVar[dict[str, list[EngineOptions]]] = {}
    failures: ClassVar[list[str]] = []
    # Model ids whose next load fails (the engine exits before Ready).
    broken: ClassVar[set[str]] = set()

    def __init__(self, entry: CatalogEntry, run_dir: Path, serial: int):
        super().__init__(entry, run_dir, serial)
        self.gpu = (int(self.options.device.removeprefix("cuda:"))
                    if self.options.device.startswith("cuda:") else None)
        self.size = int(self.options.device_memory_mib * MIB * USE)

    def hold(self) -> None:
        if self.gpu is not None and GpuEngine.devices is not None:
            try:
                GpuEngine.devices.hold(self.gpu, self.entry.id, self.size)
            except OutOfMemory as exc:
                GpuEngine.failures.append(str(exc))
                raise

    def release(self, *, keep_context: bool) -> None:
        if self.gpu is not None and GpuEngine.devices is not None:
            GpuEngine.devices.drop(self.gpu, self.entry.id)
            if not keep_context:
                GpuEngine.devices.drop(self.gpu, self.entry.id + ":context")

    async def start(self, ready_within: float, on_progress: Any) -> Ready:
        GpuEngine.launched.setdefault(self.entry.id, []).append(self.options)
        if self.gpu is not None and GpuEngine.devices is not None:
            # The CUDA context comes first and is not part of what it reports.
            GpuEngine.devices.hold(self.gpu, self.entry.id + ":context", CUDA_CONTEXT_BYTES)
        return await super().start(ready_within, on_progress)

    def started_up(self) -> None:
        if self.entry.id in GpuEngine.broken:
            GpuEngine.broken.discard(self.entry.id)
            raise RuntimeError("engine exited with status 1 before it was ready")
        self.hold()

    def memory(self) -> MemoryFacts:
        return MemoryFacts(weights_bytes=self.size // 2, kv_bytes=self.size - self.size // 2)

    def slept(self) -> None:
        self.release(keep_context=True)

    def woke(self) -> None:
        self.hold()

    def stopped(self) -> None:
        self.release(keep_context=False)


@pytest.fixture(autouse=True)
def fake_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    GpuEngine.devices = None
    GpuEngine.launched = {}
    GpuEngine.failures = []
    GpuEngine.broken = set()
    use_fake_engines(monkeypatch, GpuEngine)


def checkpoint(root: Path, name: str, params: int) -> Path:
    """A Hugging Face directory whose safetensors header declares `params`
    elements (the planner reads headers only, never tensor data)."""
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000,
        "max_position_embeddings": 1024}))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [params],
                               "data_offsets": [0, 2 * params]}}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return directory


def need_of(path: Path, **settings: Any) -> int:
    """The planned footprint of a model with kv-capacity left at 0."""
    engine = ModelSettings(**settings).engine
    return estimate_footprint(read_shape(path, "hf"), engine, cuda=True).total_bytes


class Recorder:
    """The evictions the observers hear of."""

    def __init__(self) -> None:
        self.evictions: list[tuple[str, str, str, str, str | None]] = []

    def model_event(self, model: str, kind: str, seconds: float) -> None:
        pass

    def model_evicted(self, model: str, action: str, reason: str, for_model: str,
                      device: str | None) -> None:
        self.evictions.append((model, action, reason, for_model, device))


def router(tmp_path: Path, sizes: dict[str, int], devices: Any, *, models_max: int = 0,
           settings: dict[str, dict[str, Any]] | None = None) -> tuple[ModelManager, Recorder]:
    """A manager over checkpoints of these sizes (elements), on `devices`."""
    entries = {}
    for name, params in sizes.items():
        path = checkpoint(tmp_path, name, params)
        entries[name] = CatalogEntry(name, path, "hf",
                                     ModelSettings(**(settings or {}).get(name, {})))
    config = ServeConfig(models_dir=tmp_path, models_max=models_max, pending_timeout_ms=1000,
                         device_headroom_mib=HEADROOM_MIB)
    if isinstance(devices, SimulatedDevices):
        GpuEngine.devices = devices
    manager = ModelManager(Catalog(entries), config, probe=devices)
    recorder = Recorder()
    manager.observers.models.append(recorder)
    return manager, recorder


async def use(manager: ModelManager, name: str, hold: float = 0.0) -> None:
    async with manager.lease(manager.slots[name]):
        await asyncio.sleep(hold)


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def check_ledger(manager: ModelManager) -> None:
    """Never planned beyond what a GPU has for our models."""
    for book, held in manager.seats.books(probe=False):
        assert held <= book.capacity_bytes, (book, held)


async def audited(manager: ModelManager, work: Any) -> Any:
    """Run `work` while checking the ledger at every turn of the loop."""
    task = asyncio.ensure_future(work)
    while not task.done():
        check_ledger(manager)
        await asyncio.sleep(0)
    return await task


def states(manager: ModelManager) -> dict[str, ModelState]:
    return {name: slot.state for name, slot in manager.slots.items()}


ONE_GIB = GIB // 2  # bf16 elements in 1 GiB of weights


def room_for(path: Path, models: float, extra: int = 0) -> int:
    """A GPU's total that fits `models` models like `path` (and the headroom)."""
    return int(need_of(path) * models) + HEADROOM_MIB * MIB + extra


# ---- the tests ----------------------------------------------------------------------


def test_the_least_recently_used_idle_model_makes_room_on_its_gpu(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, recorder = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB, "c": ONE_GIB}, sim)
        sim.totals[0] = room_for(manager.slots["a"].entry.path, 2.5)
        await audited(manager, use(manager, "a"))
        await audited(manager, use(manager, "b"))
        await audited(manager, use(manager, "a"))  # a is now the more recently used
        await audited(manager, use(manager, "c"))
        assert states(manager) == {"a": S.LOADED, "b": S.UNLOADED, "c": S.LOADED}
        assert recorder.evictions == [("b", "unload", "device_memory", "c", "cuda:0")]
        assert GpuEngine.failures == []
        await manager.close()

    asyncio.run(scenario())


def test_an_eviction_for_memory_is_an_event_with_its_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, _ = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, sim)
        sim.totals[0] = room_for(manager.slots["a"].entry.path, 1.5)
        watcher = manager.events.subscribe()
        await use(manager, "a")
        await use(manager, "b")
        events = []
        while not watcher.queue.empty():
            events.append(watcher.queue.get_nowait())
        evicted = [e for e in events if e and e["event"] == "model_evict"]
        assert evicted == [{"model": "a", "event": "model_evict", "data": {
            "reason": "device_memory", "for_model": "b", "action": "unload",
            "device": "cuda:0"}}]
        await manager.close()

    asyncio.run(scenario())


def test_a_model_with_requests_in_flight_is_never_evicted(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, recorder = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB, "c": ONE_GIB}, sim)
        sim.totals[0] = room_for(manager.slots["a"].entry.path, 2.5)
        await use(manager, "a")
        await use(manager, "b")
        # a is the least recently used, but busy: b goes instead.
        busy = asyncio.create_task(use(manager, "a", hold=0.2))
        await until(lambda: manager.slots["a"].in_flight == 1)
        await audited(manager, use(manager, "c"))
        assert recorder.evictions[0][:3] == ("b", "unload", "device_memory")
        # Now a and c are busy: d... here b waits until one of them is idle.
        busy_c = asyncio.create_task(use(manager, "c", hold=0.2))
        await until(lambda: manager.slots["c"].in_flight == 1)
        waiting = asyncio.create_task(use(manager, "b"))
        await asyncio.sleep(0.05)
        assert manager.slots["b"].state is S.UNLOADED and manager.seats.waiting == 1
        await audited(manager, asyncio.gather(busy, busy_c, waiting))
        assert manager.slots["b"].state is S.LOADED
        assert [e[0] for e in recorder.evictions] == ["b", "a"]
        assert GpuEngine.failures == []
        await manager.close()

    asyncio.run(scenario())


def test_models_max_still_caps_the_count(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, recorder = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, sim, models_max=1)
        sim.totals[0] = room_for(manager.slots["a"].entry.path, 10)
        await use(manager, "a")
        await use(manager, "b")
        assert states(manager) == {"a": S.UNLOADED, "b": S.LOADED}
        assert recorder.evictions == [("a", "unload", "models_max", "b", "cuda:0")]
        await manager.close()

    asyncio.run(scenario())


def test_an_unpinned_model_goes_where_it_needs_the_fewest_evictions(tmp_path: Path) -> None:
    async def scenario() -> None:
        sizes = {"a": ONE_GIB, "b": ONE_GIB, "c": ONE_GIB, "d": ONE_GIB}
        sim = SimulatedDevices([0, 0])
        manager, recorder = router(tmp_path, sizes, sim)
        path = manager.slots["a"].entry.path
        # GPU 1 has more room: the first model goes there (no eviction either way).
        sim.totals[:] = [room_for(path, 1.5), room_for(path, 2.5)]
        await use(manager, "a")
        assert GpuEngine.launched["a"][-1].device == "cuda:1"
        # b fits either GPU without an eviction: GPU 1 keeps more room afterwards.
        await use(manager, "b")
        assert GpuEngine.launched["b"][-1].device == "cuda:1"
        # c fits GPU 0 as it is, but GPU 1 only after an eviction: GPU 0.
        await use(manager, "c")
        assert GpuEngine.launched["c"][-1].device == "cuda:0"
        assert recorder.evictions == []
        # Every GPU is full: one eviction either way, and GPU 1 has more room
        # left after its least recently used model (a) goes.
        await audited(manager, use(manager, "d"))
        assert GpuEngine.launched["d"][-1].device == "cuda:1"
        assert recorder.evictions == [("a", "unload", "device_memory", "d", "cuda:1")]
        assert GpuEngine.failures == []
        await manager.close()

    asyncio.run(scenario())


def test_the_gpu_with_fewer_evictions_wins_over_more_room(tmp_path: Path) -> None:
    async def scenario() -> None:
        sizes = {"a": ONE_GIB, "b": ONE_GIB, "big": ONE_GIB, "c": ONE_GIB}
        sim = SimulatedDevices([0, 0])
        manager, recorder = router(tmp_path, sizes, sim,
                                   settings={"a": {"device": "cuda:0"}, "b": {"device": "cuda:1"},
                                             "big": {"device": "cuda:1"}})
        path = manager.slots["a"].entry.path
        sim.totals[:] = [room_for(path, 1.2), room_for(path, 2.2)]
        await use(manager, "a")  # GPU 0 full
        await use(manager, "b")
        await use(manager, "big")  # GPU 1 full, with two models
        await audited(manager, use(manager, "c"))
        # GPU 0 needs one eviction (a), GPU 1 one too (b, its least recently used):
        # tie, so the GPU with more room left afterwards (GPU 1).
        assert GpuEngine.launched["c"][-1].device == "cuda:1"
        assert recorder.evictions == [("b", "unload", "device_memory", "c", "cuda:1")]
        await manager.close()

    asyncio.run(scenario())


def test_what_can_never_fit_is_refused_at_once_with_the_numbers(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0, 0])
        manager, _ = router(tmp_path, {"small": ONE_GIB, "huge": 8 * ONE_GIB}, sim)
        sim.totals[:] = [room_for(manager.slots["small"].entry.path, 3)] * 2
        await use(manager, "small")
        started = asyncio.get_running_loop().time()
        with pytest.raises(Unavailable) as caught:
            await use(manager, "huge")
        assert asyncio.get_running_loop().time() - started < 0.5  # not after the 1 s wait
        error = caught.value
        assert error.code == "insufficient_device_memory"
        need = need_of(manager.slots["huge"].entry.path)
        assert f"needs {need / GIB:.2f} GiB" in error.message
        assert "cannot fit even alone" in error.message and "(tried GPU 0, 1)" in error.message
        assert "GPU 0 (Simulated GPU) has" in error.message and "headroom" in error.message
        # Nothing was evicted or started for it.
        assert manager.slots["small"].state is S.LOADED
        assert "start huge" not in FakeEngine.log
        await manager.close()

    asyncio.run(scenario())


def test_other_processes_memory_counts(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, recorder = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, sim)
        path = manager.slots["a"].entry.path
        # Room for three of ours, but another process holds one model's worth.
        sim.totals[0] = room_for(path, 3)
        sim.other[0] = need_of(path) + need_of(path) // 2
        await use(manager, "a")
        await audited(manager, use(manager, "b"))
        assert recorder.evictions == [("a", "unload", "device_memory", "b", "cuda:0")]
        (book, _), = manager.seats.books()
        assert book.other_bytes >= sim.other[0]
        assert GpuEngine.failures == []
        await manager.close()

    asyncio.run(scenario())


def test_a_pinned_gpu_the_router_does_not_have_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        manager, _ = router(tmp_path, {"a": ONE_GIB}, SimulatedDevices([64 * GIB]),
                            settings={"a": {"device": "cuda:3"}})
        with pytest.raises(Unavailable, match="pinned to GPU 3") as caught:
            await use(manager, "a")
        assert caught.value.code == "insufficient_device_memory"
        await manager.close()

    asyncio.run(scenario())


def test_sleeping_models_wake_by_re_planning_and_give_memory_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        suspend = {"model_suspend": True}
        manager, recorder = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, sim,
                                   settings={"a": suspend, "b": suspend})
        sim.totals[0] = room_for(manager.slots["a"].entry.path, 1.5)
        await use(manager, "a")
        await audited(manager, use(manager, "b"))
        assert states(manager) == {"a": S.SLEEPING, "b": S.LOADED}
        assert ("a", 0) not in sim.held and (0, "a") not in sim.held
        # Waking a re-plans: b is put to sleep for it, on the same GPU.
        await audited(manager, use(manager, "a"))
        assert states(manager) == {"a": S.LOADED, "b": S.SLEEPING}
        assert [e[:4] for e in recorder.evictions] == [
            ("a", "sleep", "device_memory", "b"), ("b", "sleep", "device_memory", "a")]
        assert FakeEngine.log.count("start a") == 1  # a woke, it was not loaded again
        assert GpuEngine.failures == []
        await manager.close()

    asyncio.run(scenario())


def test_a_failed_load_gives_its_planned_memory_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, _ = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, sim)
        sim.totals[0] = room_for(manager.slots["a"].entry.path, 1.5)
        GpuEngine.broken.add("a")
        with pytest.raises(Unavailable, match="failed to load"):
            await use(manager, "a")
        assert manager.seats.books(probe=False)[0][1] == 0
        await audited(manager, use(manager, "b"))
        assert manager.slots["b"].state is S.LOADED and GpuEngine.failures == []
        await manager.close()

    asyncio.run(scenario())


def test_grants_and_the_lone_model_fill(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, _ = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, sim)
        path = manager.slots["a"].entry.path
        sim.totals[0] = room_for(path, 3)
        await use(manager, "a")
        launched = GpuEngine.launched["a"][-1]
        # Two models may share the GPU: a is given what it needs, its pool sized to its lanes.
        assert launched.kv_capacity_tokens == 0
        assert launched.device_memory_mib == (need_of(path) - CUDA_CONTEXT_BYTES) // MIB
        await manager.close()

        GpuEngine.launched = {}
        alone, _ = router(tmp_path / "alone", {"only": ONE_GIB}, SimulatedDevices([32 * GIB]))
        await use(alone, "only")
        launched = GpuEngine.launched["only"][-1]
        capacity = 32 * GIB - HEADROOM_MIB * MIB
        assert launched.kv_capacity_tokens == -1  # the prefix cache may fill the GPU
        assert launched.device_memory_mib == (capacity - CUDA_CONTEXT_BYTES) // MIB
        await alone.close()

    (tmp_path / "alone").mkdir()
    asyncio.run(scenario())


def test_a_reload_is_planned_with_what_the_engine_reported(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, _ = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, sim)
        sim.totals[0] = room_for(manager.slots["a"].entry.path, 3)
        slot = manager.slots["a"]
        await use(manager, "a")
        reported = slot.ready.memory.footprint_bytes
        await manager.unload(slot)
        demand = manager.needs.demand(slot)
        assert demand.need_bytes == reported + 64 * MIB + CUDA_CONTEXT_BYTES
        await manager.close()

    asyncio.run(scenario())


def test_without_gpus_models_run_on_the_cpu_counted_only(tmp_path: Path) -> None:
    async def scenario() -> None:
        manager, recorder = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, NoDevices(),
                                   models_max=1)
        await use(manager, "a")
        await use(manager, "b")
        assert [o.device for o in GpuEngine.launched["a"] + GpuEngine.launched["b"]] == \
            ["cpu", "cpu"]
        assert GpuEngine.launched["a"][-1] == EngineOptions()  # exactly as before
        assert recorder.evictions == [("a", "unload", "models_max", "b", "cpu")]
        assert manager.seats.books() == []
        await manager.close()

    asyncio.run(scenario())


def test_observers_fan_out_evictions() -> None:
    observers = Observers()
    recorder = Recorder()
    observers.models.append(recorder)
    observers.model_evicted("a", "sleep", "models_max", "b", None)
    assert recorder.evictions == [("a", "sleep", "models_max", "b", None)]


def test_cards_and_load_show_devices_and_bytes(tmp_path: Path) -> None:
    from router.http.models_api import device_memory
    from router.http.status import device_ledger

    async def scenario() -> None:
        sim = SimulatedDevices([0])
        manager, _ = router(tmp_path, {"a": ONE_GIB, "b": ONE_GIB}, sim)
        path = manager.slots["a"].entry.path
        sim.totals[0] = room_for(path, 3)
        sim.other[0] = GIB
        await use(manager, "a")
        shown = device_memory(manager, manager.slots["a"])
        held = manager.slots["a"].ready.memory
        assert shown["device"] == "cuda:0" and shown["planned_bytes"] == need_of(path)
        assert shown["held"]["weights_bytes"] == held.weights_bytes
        assert shown["held"]["footprint_bytes"] == held.footprint_bytes
        # Not loaded yet: its estimate once known, else null.
        assert device_memory(manager, manager.slots["b"]) == {
            "device": None, "planned_bytes": None, "held": None}
        (ledger,) = device_ledger(manager)
        assert ledger == {"index": 0, "name": "Simulated GPU", "total_bytes": sim.totals[0],
                          "free_bytes": sim.free(0),
                          "planned_bytes": held.footprint_bytes + CUDA_CONTEXT_BYTES,
                          "other_bytes": GIB, "headroom_bytes": HEADROOM_MIB * MIB}
        await manager.close()

    asyncio.run(scenario())


def test_gpus_without_cupy_are_reported_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    import router.lifecycle.manager as manager_module

    async def scenario(installed: bool, devices: Any) -> str:
        monkeypatch.setattr(manager_module, "cuda_kernels_installed", lambda: installed)
        manager = ModelManager(Catalog({}), ServeConfig(models_dir=tmp_path), probe=devices)
        await manager._discover_devices()
        await manager.close()
        return manager.cuda_kernels

    assert asyncio.run(scenario(False, SimulatedDevices([GIB]))) == "cupy_missing"
    assert "CuPy is not installed" in caplog.text and "roundhouse[cuda13]" in caplog.text
    caplog.clear()
    assert asyncio.run(scenario(True, SimulatedDevices([GIB]))) == "available"
    assert asyncio.run(scenario(False, NoDevices())) == "no_gpu"
    assert "CuPy" not in caplog.text


def test_a_device_memory_share_is_planned_and_granted_exactly(tmp_path: Path) -> None:
    async def scenario() -> None:
        sim = SimulatedDevices([0])
        share_mib = 3 * 1024
        manager, recorder = router(
            tmp_path, {"a": ONE_GIB, "b": ONE_GIB, "tiny": ONE_GIB}, sim,
            settings={"a": {"engine": EngineOptions(device_memory_mib=share_mib)},
                      "b": {"engine": EngineOptions(device_memory_mib=share_mib)},
                      "tiny": {"engine": EngineOptions(device_memory_mib=64)}})
        # Room for one share and a half: the second share evicts the first.
        sim.totals[0] = int(1.5 * (share_mib * MIB + CUDA_CONTEXT_BYTES)) + HEADROOM_MIB * MIB
        await audited(manager, use(manager, "a"))
        launched = GpuEngine.launched["a"][-1]
        # The share is the grant, and the KV pool fills it.
        assert launched.device_memory_mib == share_mib and launched.kv_capacity_tokens == -1
        await audited(manager, use(manager, "b"))
        assert states(manager)["a"] is S.UNLOADED and states(manager)["b"] is S.LOADED
        assert recorder.evictions == [("a", "unload", "device_memory", "b", "cuda:0")]
        # A share below the weights and the largest step can never work.
        with pytest.raises(Unavailable) as caught:
            await use(manager, "tiny")
        assert caught.value.code == "insufficient_device_memory"
        assert "device-memory-mib share (64 MiB) is below" in caught.value.message
        assert GpuEngine.failures == []
        await manager.close()

    asyncio.run(scenario())
