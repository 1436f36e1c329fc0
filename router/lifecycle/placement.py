"""What a model asks of the devices before its load or wake (a Demand), where
the planner puts it (a Placement), and the facts both are made from: the GPUs
(router/devices.py), each checkpoint's shapes (router/footprint.py) and the
footprint each model's engine reported once loaded.

DeviceNeeds only describes; the decisions (who goes where, who is evicted)
are the SeatArbiter's alone (router/lifecycle/seats.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from protocol import MemoryFacts
from router.catalog import CatalogEntry
from router.config import ServeConfig
from router.devices import DeviceMemory, DeviceProbe
from router.errors import Unavailable
from router.footprint import (
    CUDA_CONTEXT_BYTES,
    MIB,
    Footprint,
    ModelShape,
    estimate_footprint,
    read_shape,
)
from router.lifecycle.slot import ModelSlot, ModelState

log = logging.getLogger(__name__)

# A reload planned from the footprint an engine reported gets this much more
# than it reported: the engine sets aside the largest step's activations and
# the graphs' pool (plus 64 MiB) before it sizes its KV pool, more than the
# graphs finally took, and must find the same KV pool within its grant.
RELOAD_SLACK_BYTES = 64 * MIB


@dataclass(frozen=True)
class Demand:
    """What one load or wake asks for."""

    # What the engine is told when the model is not planned by bytes: "cpu",
    # or a GPU the router does not know (no NVML), left to the engine.
    engine_device: str
    # Candidate GPUs, planned by bytes; empty: counted under --models-max only.
    gpus: tuple[int, ...] = ()
    # The least device memory it can run in (its CUDA context included).
    need_bytes: int = 0
    # Its KV pool takes all the room the device has beyond the need.
    fill: bool = False
    # Of need_bytes, what the engine does not count itself (its CUDA context).
    runtime_bytes: int = 0
    # How the need was reckoned, for the refusal's message.
    detail: str = ""
    # Why it can never be placed (a pinned GPU the router does not have).
    refusal: str | None = None


@dataclass(frozen=True)
class Placement:
    """Where a load or wake was granted, and the bytes the ledger counts for
    it until its engine reports what it holds."""

    engine_device: str
    gpu: int | None = None
    planned_bytes: int = 0
    # The engine's device_memory_mib (0: not planned by bytes).
    grant_mib: int = 0
    # The engine's KV pool fills its grant (kv-capacity -1).
    fill: bool = False


def held_bytes(slot: ModelSlot, placement: Placement) -> int:
    """What the ledger counts for a holder: the footprint its engine reported
    (kept while it sleeps, so a wake is planned with it) plus its process's
    CUDA context, which the engine does not count; else the plan."""
    ready = slot.ready
    if ready is not None and ready.memory.footprint_bytes:
        context = CUDA_CONTEXT_BYTES if placement.gpu is not None else 0
        return ready.memory.footprint_bytes + context
    return placement.planned_bytes


def freed_bytes(slot: ModelSlot, placement: Placement) -> int:
    """What evicting a holder gives back: all it holds when it is unloaded;
    a model put to sleep keeps its process, and so its CUDA context."""
    held = held_bytes(slot, placement)
    if slot.entry.settings.model_suspend and placement.gpu is not None:
        return max(held - CUDA_CONTEXT_BYTES, 0)
    return held


class DeviceNeeds:
    def __init__(self, config: ServeConfig, probe: DeviceProbe,
                 catalog_slots: Callable[[], Iterable[ModelSlot]]):
        self._config = config
        self._probe = probe
        self._catalog_slots = catalog_slots
        self._found: list[DeviceMemory] | None = None
        self._discovery: asyncio.Task[list[DeviceMemory]] | None = None
        self._shapes: dict[CatalogEntry, ModelShape] = {}
        # What each model's engine reported after a load on a GPU.
        self._reported: dict[CatalogEntry, MemoryFacts] = {}

    # ---- the GPUs ---------------------------------------------------------------------

    async def discover(self) -> list[DeviceMemory]:
        """The first probe, off the event loop (opening NVML takes a while)."""
        if self._found is None:
            if self._discovery is None:
                self._discovery = asyncio.create_task(asyncio.to_thread(self._probe.devices))
            self._found = self._usable(await asyncio.shield(self._discovery))
            if self._config.devices is not None:
                missing = set(self._config.devices) - {d.index for d in self._found}
                if missing:
                    log.warning("--devices names GPU(s) %s that this host does not show",
                                ", ".join(str(i) for i in sorted(missing)))
        return self._found

    def _usable(self, found: list[DeviceMemory]) -> list[DeviceMemory]:
        wanted = self._config.devices
        if wanted is None:
            return found
        return [device for device in found if device.index in wanted]

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPUs models are placed on (empty before discovery or without any)."""
        return tuple(device.index for device in self._found or ())

    def probe(self) -> dict[int, DeviceMemory]:
        """Every planned GPU's memory now."""
        if not self.gpus:
            return {}
        return {device.index: device for device in self._usable(self._probe.devices())}

    # ---- one model's demand -------------------------------------------------------------

    def candidates(self, entry: CatalogEntry) -> tuple[int, ...] | str | None:
        """The GPUs an entry may go to; None: not planned by bytes; a string:
        why it can never be placed."""
        setting = entry.settings.device
        gpus = self.gpus
        if setting == "cpu" or not gpus:
            return None
        if setting in ("auto", "cuda"):
            return gpus
        index = int(setting.removeprefix("cuda:"))
        if index not in gpus:
            return (f"it is pinned to GPU {index} (device {setting}), which is not among the "
                    f"router's GPUs ({', '.join(str(g) for g in gpus)}; see --devices)")
        return (index,)

    async def prepare(self, slot: ModelSlot) -> None:
        """Read what the demand needs from disk, off the event loop: the
        checkpoint's shapes, once per catalog entry."""
        await self.discover()
        entry = slot.entry
        if entry in self._shapes or not isinstance(self.candidates(entry), tuple):
            return
        try:
            self._shapes[entry] = await asyncio.to_thread(read_shape, entry.path, entry.format)
        except ValueError as exc:
            raise Unavailable(f"model '{slot.id}': cannot plan its device memory: {exc}",
                              code="model_load_failed") from None

    def demand(self, slot: ModelSlot) -> Demand:
        entry = slot.entry
        found = self.candidates(entry)
        if found is None:
            setting = entry.settings.device
            return Demand("cpu" if setting == "auto" else setting)
        if isinstance(found, str):
            return Demand("", refusal=found)
        placement = slot.placement
        if slot.state in (ModelState.SLEEPING, ModelState.SUSPENDING) and placement is not None:
            # A wake stays where its engine is, with the pool it already has.
            if placement.gpu is None:
                return Demand(placement.engine_device)
            # Its process, and so its CUDA context, stayed: the ledger counts
            # that context already (SeatArbiter._resident).
            ready = slot.ready
            need = (ready.memory.footprint_bytes if ready is not None
                    and ready.memory.footprint_bytes else placement.planned_bytes)
            return Demand(placement.engine_device, (placement.gpu,), need,
                          detail=f"what its engine held before it slept ({need / 2**30:.2f} GiB)")
        engine = entry.settings.engine
        if engine.device_memory_mib:
            return self._share_demand(slot, found)
        fill = engine.kv_capacity_tokens < 0 or (
            engine.kv_capacity_tokens == 0 and self._alone(entry, found))
        estimate = estimate_footprint(self._shapes[entry], engine, cuda=True, fill=fill)
        reported = self._reported.get(entry)
        if reported is not None and not fill:
            grant = reported.footprint_bytes + reported.activation_bytes + RELOAD_SLACK_BYTES
            return Demand("", found, grant + CUDA_CONTEXT_BYTES,
                          runtime_bytes=CUDA_CONTEXT_BYTES,
                          detail=f"what its engine reported at its last load "
                                 f"({reported.footprint_bytes / 2**30:.2f} GiB) plus slack")
        return Demand("", found, estimate.total_bytes, fill=fill,
                      runtime_bytes=estimate.runtime_bytes, detail=_detail(estimate, fill))

    def _share_demand(self, slot: ModelSlot, gpus: tuple[int, ...]) -> Demand:
        """A model given its share (device-memory-mib) asks for exactly that:
        its engine sizes its KV pool within it. A share below what the model
        needs without any KV can never work, and is refused at once."""
        engine = slot.entry.settings.engine
        share = engine.device_memory_mib * MIB
        least = estimate_footprint(self._shapes[slot.entry], engine, cuda=True)
        floor = least.weights_bytes + least.activation_bytes
        if share < floor:
            return Demand("", refusal=(
                f"its device-memory-mib share ({engine.device_memory_mib} MiB) is below what "
                f"its weights and largest step need before any KV cache "
                f"({floor / MIB:.0f} MiB: {least.describe()})"))
        return Demand("", gpus, share + CUDA_CONTEXT_BYTES, runtime_bytes=CUDA_CONTEXT_BYTES,
                      detail=f"its device-memory-mib share ({engine.device_memory_mib} MiB) "
                             "plus its CUDA context")

    def _alone(self, entry: CatalogEntry, gpus: tuple[int, ...]) -> bool:
        """No other catalog model could be placed on these GPUs: the KV pool
        may then fill the device for the prefix cache."""
        for other in self._catalog_slots():
            if other.entry is entry or other.entry.id == entry.id:
                continue
            theirs = self.candidates(other.entry)
            if isinstance(theirs, tuple) and set(theirs) & set(gpus):
                return False
        return True

    def slots(self) -> Iterable[ModelSlot]:
        return self._catalog_slots()

    def estimate(self, slot: ModelSlot) -> Footprint | None:
        """The planned footprint of a model not yet loaded (None: unknown yet)."""
        shape = self._shapes.get(slot.entry)
        if shape is None:
            return None
        return estimate_footprint(shape, slot.entry.settings.engine, cuda=True)

    def remember(self, slot: ModelSlot) -> None:
        """A model loaded on a GPU: plan its later loads with what it holds."""
        placement, ready = slot.placement, slot.ready
        if placement is None or placement.gpu is None or ready is None:
            return
        if ready.memory.footprint_bytes and not placement.fill:
            self._reported[slot.entry] = ready.memory


def _detail(estimate: Footprint, fill: bool) -> str:
    what = "the least it runs in" if fill else "estimated from its checkpoint"
    return f"{what}: {estimate.describe()}"
