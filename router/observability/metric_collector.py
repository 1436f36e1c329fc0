"""The engine-derived series of GET /metrics, built at scrape time.

Each engine publishes its counters with every step (EngineStats in
StepOutputs); the router keeps the latest in `engine.client.stats`. A scrape
reads those and never talks to an engine, so it cannot load, wake or wait on
one, and the counters advance while a long generation runs, not only when it
ends.

An engine's counters start from zero, so a model's totals add up its engines:
the slot keeps those of engines that have ended (unloaded or failed; see
ModelSlot.counters), and the live one's are added, so even one that starts and
dies between two scrapes is counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from protocol import EngineStats
from router.lifecycle import ModelManager, ModelSlot, ModelState

MODEL_STATES = tuple(dict.fromkeys(state.public for state in ModelState))
LLAMACPP_PREFIX = "llamacpp:"


@dataclass(frozen=True)
class ModelView:
    """What one model's series are computed from."""

    slot: ModelSlot
    totals: dict[str, float]
    # The live engine's latest stats; zeros when no engine runs.
    live: EngineStats


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def _deferred(view: ModelView) -> float:
    # Waiting for the model to load or wake, for a lane, or in the engine's
    # queue for KV: llama.cpp's "deferred" is any request not yet computing.
    slot = view.slot
    return slot.pending + slot.lanes.waiting + view.live.waiting


@dataclass(frozen=True)
class Series:
    name: str
    kind: str  # "counter" or "gauge"
    help: str
    value: Callable[[ModelView], float]


SERIES: tuple[Series, ...] = (
    Series("llamacpp:prompt_tokens_total", "counter",
           "Number of prompt tokens processed (computed; prefix-cache hits excluded).",
           lambda v: v.totals["prefill_tokens_total"]),
    Series("llamacpp:prompt_seconds_total", "counter",
           "Prompt process time in seconds (each step's time shared by token count).",
           lambda v: v.totals["prefill_seconds_total"]),
    Series("llamacpp:prompt_tokens_cached_total", "counter",
           "Number of prompt tokens reused from the prefix cache instead of computed.",
           lambda v: v.totals["cached_tokens_total"]),
    Series("llamacpp:tokens_predicted_total", "counter",
           "Number of generation tokens processed.",
           lambda v: v.totals["generated_tokens_total"]),
    Series("llamacpp:tokens_predicted_seconds_total", "counter",
           "Predict process time in seconds (each step's time shared by token count).",
           lambda v: v.totals["decode_seconds_total"]),
    Series("llamacpp:prompt_tokens_seconds", "gauge",
           "Average prompt throughput in tokens/s since the server started.",
           lambda v: _ratio(v.totals["prefill_tokens_total"], v.totals["prefill_seconds_total"])),
    Series("llamacpp:predicted_tokens_seconds", "gauge",
           "Average generation throughput in tokens/s since the server started.",
           lambda v: _ratio(v.totals["generated_tokens_total"], v.totals["decode_seconds_total"])),
    Series("llamacpp:n_decode_total", "counter",
           "Total number of engine steps that ran the model (llama_decode() calls).",
           lambda v: v.totals["forward_passes_total"]),
    Series("llamacpp:n_busy_slots_per_decode", "gauge",
           "Average number of sequences per engine step.",
           lambda v: _ratio(v.totals["busy_slots_total"], v.totals["forward_passes_total"])),
    Series("llamacpp:kv_cache_usage_ratio", "gauge",
           "KV-cache usage: pages held by running sequences over all pages. 1 means 100 percent usage.",
           lambda v: _ratio(v.live.kv_pages_used, v.live.kv_pages_total)),
    Series("llamacpp:kv_cache_tokens", "gauge",
           "KV-cache tokens held by running sequences.",
           lambda v: v.live.kv_tokens_used),
    Series("llamacpp:requests_processing", "gauge",
           "Number of requests processing (running in the engine).",
           lambda v: v.live.running),
    Series("llamacpp:requests_deferred", "gauge",
           "Number of requests deferred (waiting for the model, a lane or KV).",
           _deferred),
    Series("roundhouse:prompt_tokens_received_total", "counter",
           "Prompt tokens the engine received, prefix-cache hits included.",
           lambda v: v.totals["prompt_tokens_total"]),
    Series("roundhouse:prompt_tokens_cached_total", "counter",
           "Prompt tokens reused from the prefix cache instead of computed.",
           lambda v: v.totals["cached_tokens_total"]),
    Series("roundhouse:host_kv_hit_pages_total", "counter",
           "KV pages found in the host tier and copied back to the device.",
           lambda v: v.totals["host_kv_hit_pages_total"]),
    Series("roundhouse:host_kv_hit_tokens_total", "counter",
           "Prompt tokens served from the host tier (part of prompt_tokens_cached_total).",
           lambda v: v.totals["host_kv_hit_tokens_total"]),
    Series("roundhouse:host_kv_misses_total", "counter",
           "Admissions whose prefix lookup stopped at a page neither the device nor the "
           "host tier held.",
           lambda v: v.totals["host_kv_misses_total"]),
    Series("roundhouse:host_kv_stored_pages_total", "counter",
           "KV pages the device evicted and the host tier stored.",
           lambda v: v.totals["host_kv_stored_pages_total"]),
    Series("roundhouse:host_kv_evicted_pages_total", "counter",
           "KV pages the host tier evicted (least recently used) to make room.",
           lambda v: v.totals["host_kv_evicted_pages_total"]),
    Series("roundhouse:host_kv_bytes_to_host_total", "counter",
           "Bytes of KV copied from the device to the host tier.",
           lambda v: v.totals["host_kv_bytes_to_host_total"]),
    Series("roundhouse:host_kv_bytes_to_device_total", "counter",
           "Bytes of KV copied from the host tier back to the device.",
           lambda v: v.totals["host_kv_bytes_to_device_total"]),
    Series("roundhouse:host_kv_pages", "gauge",
           "KV pages the host tier holds now.",
           lambda v: v.live.host_kv_pages_cached),
    Series("roundhouse:host_kv_capacity_pages", "gauge",
           "KV pages the host tier can hold (0: off).",
           lambda v: v.live.host_kv_pages_total),
    Series("roundhouse:disk_kv_hit_pages_total", "counter",
           "KV pages read back from the disk tier.",
           lambda v: v.totals["disk_kv_hit_pages_total"]),
    Series("roundhouse:disk_kv_hit_tokens_total", "counter",
           "Prompt tokens served from the disk tier (part of prompt_tokens_cached_total).",
           lambda v: v.totals["disk_kv_hit_tokens_total"]),
    Series("roundhouse:disk_kv_misses_total", "counter",
           "Admissions whose prefix lookup stopped at a page no tier held or could read.",
           lambda v: v.totals["disk_kv_misses_total"]),
    Series("roundhouse:disk_kv_written_pages_total", "counter",
           "KV page files the disk tier wrote.",
           lambda v: v.totals["disk_kv_written_pages_total"]),
    Series("roundhouse:disk_kv_evicted_pages_total", "counter",
           "KV page files the disk tier deleted (least recently used) to stay in its budget.",
           lambda v: v.totals["disk_kv_evicted_pages_total"]),
    Series("roundhouse:disk_kv_bytes_read_total", "counter",
           "Bytes of KV page files read back from the disk tier.",
           lambda v: v.totals["disk_kv_bytes_read_total"]),
    Series("roundhouse:disk_kv_bytes_written_total", "counter",
           "Bytes of KV page files written to the disk tier.",
           lambda v: v.totals["disk_kv_bytes_written_total"]),
    Series("roundhouse:disk_kv_corrupt_pages_total", "counter",
           "KV page files found torn, truncated, altered or foreign, and deleted.",
           lambda v: v.totals["disk_kv_corrupt_pages_total"]),
    Series("roundhouse:disk_kv_dropped_pages_total", "counter",
           "KV pages the disk tier could not write (a full disk, a write error, the writer behind).",
           lambda v: v.totals["disk_kv_dropped_pages_total"]),
    Series("roundhouse:disk_kv_orphan_pages_total", "counter",
           "KV pages the disk tier did not write: their parent page was not on disk.",
           lambda v: v.totals["disk_kv_orphan_pages_total"]),
    Series("roundhouse:disk_kv_deadline_hits_total", "counter",
           "Disk tier restores cut short by --disk-kv-restore-ms (the rest computed).",
           lambda v: v.totals["disk_kv_deadline_hits_total"]),
    Series("roundhouse:disk_kv_skipped_total", "counter",
           "Disk tier restores not started: judged slower than computing the same tokens.",
           lambda v: v.totals["disk_kv_skipped_total"]),
    Series("roundhouse:disk_kv_restore_seconds_total", "counter",
           "Seconds spent reading KV pages back from the disk tier.",
           lambda v: v.totals["disk_kv_restore_seconds_total"]),
    Series("roundhouse:disk_kv_pages", "gauge",
           "KV page files the disk tier holds now.",
           lambda v: v.live.disk_kv_pages_cached),
    Series("roundhouse:disk_kv_bytes", "gauge",
           "Bytes of KV page files the disk tier holds now.",
           lambda v: v.live.disk_kv_bytes_cached),
    Series("roundhouse:disk_kv_capacity_bytes", "gauge",
           "Bytes the disk tier may hold (0: off).",
           lambda v: v.live.disk_kv_capacity_bytes),
    Series("roundhouse:partial_kv_hits_total", "counter",
           "Admissions that reused the leading tokens of a cached page beyond their whole "
           "pages (copied into a fresh page).",
           lambda v: v.totals["partial_kv_hits_total"]),
    Series("roundhouse:partial_kv_hit_tokens_total", "counter",
           "Prompt tokens reused to the token from such pages (part of "
           "prompt_tokens_cached_total).",
           lambda v: v.totals["partial_kv_hit_tokens_total"]),
    Series("roundhouse:draft_tokens_total", "counter",
           "Draft tokens verified by speculative decoding (--spec).",
           lambda v: v.totals["draft_tokens_total"]),
    Series("roundhouse:draft_accepted_tokens_total", "counter",
           "Draft tokens the model agreed with: tokens gained over plain decoding "
           "(part of llamacpp:tokens_predicted_total).",
           lambda v: v.totals["draft_accepted_tokens_total"]),
    Series("roundhouse:preemptions_total", "counter",
           "Running sequences preempted for lack of KV pages (recomputed later).",
           lambda v: v.totals["preemptions_total"]),
    Series("roundhouse:requests_in_flight", "gauge",
           "Requests holding the model (running or waiting for a lane).",
           lambda v: v.slot.in_flight),
)


class EngineCollector:
    """A prometheus_client collector of the engine-derived series.

    On a single-model server the llamacpp: series carry no `model` label, as
    llama-server's do, so dashboards written for it query them bare."""

    def __init__(self, manager: ModelManager):
        self._manager = manager
        self._bare = manager.single

    def view(self, slot: ModelSlot) -> ModelView:
        engine = slot.engine
        live = engine.client.stats if engine is not None else EngineStats()
        return ModelView(slot, dict(slot.counters()), live)

    def collect(self) -> Iterator[Metric]:
        views = [self.view(slot) for slot in list(self._manager.slots.values())]
        for series in SERIES:
            family_type = CounterMetricFamily if series.kind == "counter" else GaugeMetricFamily
            bare = self._bare and series.name.startswith(LLAMACPP_PREFIX)
            family = family_type(series.name, series.help, labels=[] if bare else ["model"])
            for view in views:
                family.add_metric([] if bare else [view.slot.id], float(series.value(view)))
            yield family
        state = GaugeMetricFamily("roundhouse:model_state",
                                  "1 for the model's current status (as GET /models shows it), else 0.",
                                  labels=["model", "state"])
        for view in views:
            for name in MODEL_STATES:
                state.add_metric([view.slot.id, name], float(view.slot.state.public == name))
        yield state
