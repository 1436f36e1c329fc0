"""One catalog model's place in the lifecycle.

    UNLOADED ──load──> LOADING ──Ready──> LOADED ──evict/unload──> UNLOADING ──> UNLOADED
       ^                  │                │  ^
       └──────failed──────┘          sleep │  │ wake
                                           v  │
                              SUSPENDING ──> SLEEPING ──wake──> WAKING ──Awake──> LOADED

SUSPENDING and WAKING are the transitions into and out of SLEEPING; clients
see them as "sleeping" and "loading" (llama.cpp's router has no names for
them). A failed load, or an engine that dies, leaves the model UNLOADED with
`failed` and `error` set until its next load.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol import Ready
from router.catalog import CatalogEntry
from router.lifecycle.admission import LaneQueue
from router.supervisor import EngineProcess
from router.text.model_text import ModelText

if TYPE_CHECKING:
    from router.lifecycle.placement import Placement


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SUSPENDING = "suspending"
    SLEEPING = "sleeping"
    WAKING = "waking"
    UNLOADING = "unloading"

    @property
    def public(self) -> str:
        """The status value clients see (llama.cpp's names)."""
        return _PUBLIC.get(self, self.value)


_PUBLIC = {ModelState.SUSPENDING: "sleeping", ModelState.WAKING: "loading"}

# EngineStats counters that only grow during an engine's life.
COUNTERS = (
    "prompt_tokens_total", "cached_tokens_total", "generated_tokens_total", "preemptions_total",
    "steps_total", "prefill_tokens_total", "prefill_seconds_total", "decode_seconds_total",
    "forward_passes_total", "busy_slots_total",
    "host_kv_hit_pages_total", "host_kv_hit_tokens_total", "host_kv_misses_total",
    "host_kv_stored_pages_total", "host_kv_evicted_pages_total", "host_kv_bytes_to_host_total",
    "host_kv_bytes_to_device_total",
    "disk_kv_hit_pages_total", "disk_kv_hit_tokens_total", "disk_kv_misses_total",
    "disk_kv_written_pages_total", "disk_kv_evicted_pages_total", "disk_kv_bytes_read_total",
    "disk_kv_bytes_written_total", "disk_kv_corrupt_pages_total", "disk_kv_dropped_pages_total",
    "disk_kv_orphan_pages_total",
    "disk_kv_deadline_hits_total", "disk_kv_skipped_total", "disk_kv_restore_seconds_total",
    "partial_kv_hits_total", "partial_kv_hit_tokens_total",
    "draft_tokens_total", "draft_accepted_tokens_total",
)


@dataclass(eq=False)
class ModelSlot:
    entry: CatalogEntry
    state: ModelState = ModelState.UNLOADED
    engine: EngineProcess | None = None
    # The engine's handshake; kept while it sleeps.
    ready: Ready | None = None
    in_flight: int = 0
    # Requests waiting for this model to load or wake; it is not evicted meanwhile.
    pending: int = 0
    # monotonic time of the last request's start or end (0: never used).
    last_used: float = 0.0
    failed: bool = False
    error: str | None = None
    exit_code: int | None = None
    progress: float = 0.0
    # Where its last load or wake was placed (device, planned bytes, grant);
    # kept while it sleeps, since a wake stays on its engine's device.
    placement: Placement | None = None
    # The transition under way (load, wake, sleep, unload), if any.
    task: asyncio.Task[None] | None = None
    text: ModelText | None = None
    text_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Requests holding the model wait here for one of its engine's lanes (a
    # new queue for every engine: router/lifecycle/admission.py).
    lanes: LaneQueue = field(default_factory=LaneQueue)
    # Token counters of this model's engines that have ended, so that the
    # totals reported stay monotonic across unloads and restarts.
    retired: dict[str, float] = field(default_factory=dict)

    def retire_engine_counters(self) -> None:
        if self.engine is None:
            return
        stats = self.engine.client.stats
        for name in COUNTERS:
            self.retired[name] = self.retired.get(name, 0) + getattr(stats, name)

    def counters(self) -> dict[str, float]:
        """Monotonic totals: ended engines plus the running one."""
        live = self.engine.client.stats if self.engine is not None else None
        return {name: self.retired.get(name, 0) + (getattr(live, name) if live is not None else 0)
                for name in COUNTERS}

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def max_context(self) -> int:
        assert self.ready is not None
        return self.ready.kv.max_context

    @property
    def lane_count(self) -> int:
        assert self.ready is not None
        return self.ready.kv.max_concurrency
