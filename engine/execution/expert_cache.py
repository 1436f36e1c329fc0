"""A device cache of host-resident experts (--expert-cache-mib with
--expert-residency host or --n-cpu-moe).

Host-resident experts stay in page-locked host memory and the expert GEMV
reads the selected ones over the bus (kernels/moe.py), at a few percent of
the device's own bandwidth. Routing is skewed: a layer picks some experts
far more often than others, so this cache keeps copies of each host-resident
layer's most used experts in device memory, and the GEMV reads a cached
expert there instead (the same values: tokens do not depend on what is
cached).

Each cached layer counts on the device, inside the CUDA graphs, how often
each of its experts was picked (usage). Every REFRESH_STEPS forward passes
the counts are copied to the host asynchronously and halved on the device
(older use weighs less), and the copy queued at the refresh before is read:
each layer's cache then aims at the experts with the highest counts,
swapping at most MAX_SWAPS experts per refresh in all (a swap moves one
expert over the bus, and the next step waits for it). Weight copies and the
slot table's update are queued on the compute stream between steps, so a
step reads either the old table with the old slots' contents or the new
table with the new.

Large steps (prefill chunks) read a host-resident layer's whole stacks,
copied to the device once per step (CudaOps._staged_experts); the cache
serves the decode-sized steps, where the bus time per token matters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.models.moe import SparseMoE
from kernels.moe import ExpertCacheView

log = logging.getLogger(__name__)

# Forward passes between refreshes: the routing statistics of a few dozen
# tokens per layer, and a swap's stall spread over many steps.
REFRESH_STEPS = 16
# Experts copied in per refresh, over all layers: at ~50 GB/s a Qwen3-30B-A3B
# expert (9.4 MB) takes ~0.2 ms, so at most ~3 ms every REFRESH_STEPS steps.
MAX_SWAPS = 16


@dataclass
class LayerCache:
    """One host-resident layer's cache: what the GEMV reads (view), the
    device-side pick counts, and which expert each slot holds (-1: none)."""

    module: SparseMoE
    view: ExpertCacheView
    usage: torch.Tensor  # int32 [E] on the device
    holds: list[int] = field(default_factory=list)

    def count(self, experts: torch.Tensor) -> None:
        """Add one step's routing (ids [T, k]) to the usage counts; no host sync."""
        flat = experts.reshape(-1).long()
        self.usage.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


class ExpertCache:
    def __init__(self, model: torch.nn.Module, budget_bytes: int, device: torch.device) -> None:
        """Slots for as many experts per host-resident layer as budget_bytes
        holds (the same number in every such layer, at most all of them)."""
        self.device = device
        modules = [m for m in model.modules() if isinstance(m, SparseMoE) and m.host_resident]
        self.layers: list[LayerCache] = []
        self.slots_per_layer = 0
        self.expert_bytes = 0
        self.swaps = 0  # experts copied in so far
        self._steps = 0
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        if not modules:
            return
        first = modules[0]
        expert_bytes = (first.gate_up_weight[0].numel() + first.down_weight[0].numel()) \
            * first.gate_up_weight.element_size()
        num_experts = first.gate_up_weight.shape[0]
        self.slots_per_layer = min(num_experts, budget_bytes // (len(modules) * expert_bytes))
        if self.slots_per_layer == 0:
            return
        slots = self.slots_per_layer
        for module in modules:
            view = ExpertCacheView(
                slots=torch.full((num_experts,), -1, dtype=torch.int32, device=device),
                gate_up=torch.empty((slots, *module.gate_up_weight.shape[1:]),
                                    dtype=module.gate_up_weight.dtype, device=device),
                down=torch.empty((slots, *module.down_weight.shape[1:]),
                                 dtype=module.down_weight.dtype, device=device))
            layer = LayerCache(module, view, torch.zeros(num_experts, dtype=torch.int32,
                                                         device=device), [-1] * slots)
            module.expert_cache = layer
            self.layers.append(layer)
        self.expert_bytes = expert_bytes

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (layer.view.slots, layer.view.gate_up, layer.view.down, layer.usage))

    def release(self) -> None:
        """Detach from the layers and drop the device memory (a sleep)."""
        for layer in self.layers:
            layer.module.expert_cache = None
        self.layers = []
        self._pending = None

    def step(self) -> None:
        """Called before every forward pass: refreshes every REFRESH_STEPS."""
        if not self.layers:
            return
        self._steps += 1
        if self._steps % REFRESH_STEPS == 0:
            self.refresh()

    def refresh(self) -> None:
        counts = self._read_pending()
        # Queue the next read of the counts, then halve them (stream order:
        # the copy reads them first).
        usage = torch.stack([layer.usage for layer in self.layers])
        cuda = self.device.type == "cuda"
        host = torch.empty(usage.shape, dtype=torch.int32, pin_memory=cuda)
        host.copy_(usage, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        for layer in self.layers:
            layer.usage.bitwise_right_shift_(1)
        self._pending = (host, event)
        if counts is not None:
            self._rebalance(counts)

    def _read_pending(self) -> np.ndarray | None:
        if self._pending is None:
            return None
        host, event = self._pending
        if event is not None:
            event.synchronize()  # queued a refresh ago: long done
        return host.numpy().copy()

    def _rebalance(self, counts: np.ndarray) -> None:
        """Bring each layer's most picked experts into its slots, at most
        MAX_SWAPS copies in all, spread over the layers in turn."""
        wanted = []
        for layer, row in zip(self.layers, counts, strict=True):
            order = np.argsort(-row, kind="stable")
            top = [int(e) for e in order[: self.slots_per_layer] if row[e] > 0]
            wanted.append([e for e in top if e not in layer.holds])
        budget = MAX_SWAPS
        changed: set[int] = set()
        while budget and any(wanted):
            for index, (layer, row) in enumerate(zip(self.layers, counts, strict=True)):
                if not budget or not wanted[index]:
                    continue
                expert = wanted[index].pop(0)
                slot = self._victim_slot(layer, row, expert)
                if slot is None:
                    wanted[index] = []
                    continue
                layer.view.gate_up[slot].copy_(layer.module.gate_up_weight[expert],
                                               non_blocking=True)
                layer.view.down[slot].copy_(layer.module.down_weight[expert], non_blocking=True)
                layer.holds[slot] = expert
                changed.add(index)
                budget -= 1
                self.swaps += 1
        for index in changed:
            self._write_slots(self.layers[index])

    def _victim_slot(self, layer: LayerCache, row: np.ndarray, incoming: int) -> int | None:
        """An empty slot, else the one holding the least picked expert if it
        was picked less than the incoming one; None to keep them all."""
        if -1 in layer.holds:
            return layer.holds.index(-1)
        slot = min(range(len(layer.holds)), key=lambda s: row[layer.holds[s]])
        return slot if row[layer.holds[slot]] < row[incoming] else None

    def _write_slots(self, layer: LayerCache) -> None:
        table = torch.full((layer.view.slots.shape[0],), -1, dtype=torch.int32)
        for slot, expert in enumerate(layer.holds):
            if expert >= 0:
                table[expert] = slot
        cuda = self.device.type == "cuda"
        layer.view.slots.copy_(table.pin_memory() if cuda else table, non_blocking=cuda)
