"""GET /metrics' series without real engines: the engine collector over
stand-in engines driven through the real lifecycle manager (restarts
included), and the router-side counters and histograms fed by hand."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol import EngineStats
from router.catalog import Catalog, CatalogEntry
from router.config import ServeConfig
from router.http.status import model_load
from router.lifecycle.manager import ModelManager
from router.lifecycle.slot import ModelSlot, ModelState
from router.observability.metrics import ServerMetrics
from router.observability.records import RequestRecord
from tests.support.fake_engines import FakeEngine, use_fake_engines
from tests.support.llamacpp_series import LLAMACPP_TYPES


@pytest.fixture(autouse=True)
def fake_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_engines(monkeypatch)


def make_manager(*names: str, single: bool = False) -> ModelManager:
    entries = {name: CatalogEntry(name, Path(f"/models/{name}"), "hf") for name in names}
    config = (ServeConfig(model=Path(f"/models/{names[0]}")) if single
              else ServeConfig(models_dir=Path("/models")))
    return ModelManager(Catalog(entries), config)


def run(scenario: Callable[[ModelManager, ServerMetrics], Awaitable[None]], *names: str,
        single: bool = False) -> None:
    async def main() -> None:
        manager = make_manager(*names, single=single)
        metrics = ServerMetrics(manager)
        metrics.subscribe(manager.observers)
        try:
            await scenario(manager, metrics)
        finally:
            await manager.close()

    asyncio.run(main())


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: ServerMetrics, model: str | None = None) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and every series' type by its exposed name."""
    text = metrics.render(model).decode()
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name + ("_total" if family.type == "counter" else "")] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


# ---- the engine collector -------------------------------------------------------------


def test_llamacpp_series_come_from_the_engines_latest_stats() -> None:
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        for name in ("a", "b"):
            await manager.load(manager.slots[name])
        a = FakeEngine.started[0]
        a.client.stats = EngineStats(
            running=3, waiting=2, kv_pages_total=8, kv_pages_used=2, kv_tokens_used=27,
            prompt_tokens_total=150, cached_tokens_total=50, generated_tokens_total=40,
            preemptions_total=1, prefill_tokens_total=100, prefill_seconds_total=0.5,
            decode_seconds_total=2.0, forward_passes_total=20, busy_slots_total=50)
        manager.slots["a"].pending = 4  # waiting for the model to load or wake
        samples, types = scrape(metrics)
        assert {name: types.get(name) for name in LLAMACPP_TYPES} == LLAMACPP_TYPES
        expected = {
            "llamacpp:prompt_tokens_total": 100, "llamacpp:prompt_seconds_total": 0.5,
            "llamacpp:prompt_tokens_cached_total": 50, "llamacpp:tokens_predicted_total": 40, "llamacpp:tokens_predicted_seconds_total": 2.0,
            "llamacpp:prompt_tokens_seconds": 200.0, "llamacpp:predicted_tokens_seconds": 20.0,
            "llamacpp:n_decode_total": 20, "llamacpp:n_busy_slots_per_decode": 2.5,
            "llamacpp:kv_cache_usage_ratio": 0.25, "llamacpp:kv_cache_tokens": 27,
            "llamacpp:requests_processing": 3, "llamacpp:requests_deferred": 6,
            "roundhouse:prompt_tokens_received_total": 150,
            "roundhouse:prompt_tokens_cached_total": 50, "roundhouse:preemptions_total": 1,
        }
        assert {name: value(samples, name, model="a") for name in expected} == expected
        # b published nothing yet: zeros, and no division by zero.
        assert {value(samples, name, model="b") for name in expected} == {0.0}
        assert value(samples, "roundhouse:model_state", model="a", state="loaded") == 1
        assert value(samples, "roundhouse:model_state", model="a", state="sleeping") == 0
        # A scrape changes nothing it reads.
        assert scrape(metrics)[0] == samples

    run(scenario, "a", "b")


def test_counters_stay_monotonic_across_engine_restarts() -> None:
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        slot = manager.slots["a"]
        await manager.load(slot)
        first = FakeEngine.started[0]
        first.client.stats = EngineStats(generated_tokens_total=100, decode_seconds_total=4.0,
                                         forward_passes_total=100, running=2, kv_pages_total=8,
                                         kv_pages_used=8)
        before, _ = scrape(metrics)
        first.die()
        await until(lambda: slot.state is ModelState.UNLOADED and slot.failed)
        after, _ = scrape(metrics)
        assert value(after, "llamacpp:tokens_predicted_total", model="a") == 100
        assert value(after, "roundhouse:engine_failures_total", model="a") == 1
        # A dead engine's last gauges are not the model's now.
        assert value(before, "llamacpp:requests_processing", model="a") == 2
        assert value(after, "llamacpp:requests_processing", model="a") == 0
        assert value(after, "llamacpp:kv_cache_usage_ratio", model="a") == 0

        # The next engine starts from zero; the totals go on from 100.
        await manager.load(slot)
        second = FakeEngine.started[1]
        second.client.stats = EngineStats(generated_tokens_total=5, decode_seconds_total=1.0,
                                          forward_passes_total=5)
        samples, _ = scrape(metrics)
        assert value(samples, "llamacpp:tokens_predicted_total", model="a") == 105
        assert value(samples, "llamacpp:tokens_predicted_seconds_total", model="a") == 5.0
        assert value(samples, "llamacpp:predicted_tokens_seconds", model="a") == 21.0

        # An engine that starts and dies between two scrapes still counts.
        for generated in (1, 2):
            FakeEngine.started[-1].die()
            await until(lambda: slot.failed)
            await manager.load(slot)
            FakeEngine.started[-1].client.stats = EngineStats(generated_tokens_total=generated)
        samples, _ = scrape(metrics)
        assert value(samples, "llamacpp:tokens_predicted_total", model="a") == 108
        assert value(samples, "roundhouse:engine_failures_total", model="a") == 3
        assert value(samples, "roundhouse:model_loads_total", model="a") == 4

        # An unload keeps the totals too.
        await manager.unload(slot)
        samples, _ = scrape(metrics)
        assert value(samples, "llamacpp:tokens_predicted_total", model="a") == 108
        assert value(samples, "roundhouse:model_unloads_total", model="a") == 1

    run(scenario, "a")


def test_the_disk_tiers_restore_counters_reach_metrics_and_load_across_restarts() -> None:
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        slot = manager.slots["a"]
        await manager.load(slot)
        FakeEngine.started[0].client.stats = EngineStats(disk_kv_deadline_hits_total=3,
                                                         disk_kv_skipped_total=5)
        FakeEngine.started[0].die()
        await until(lambda: slot.failed)
        await manager.load(slot)
        FakeEngine.started[1].client.stats = EngineStats(disk_kv_deadline_hits_total=1,
                                                         disk_kv_skipped_total=2)
        samples, types = scrape(metrics)
        assert types["roundhouse:disk_kv_skipped_total"] == "counter"
        assert value(samples, "roundhouse:disk_kv_skipped_total", model="a") == 7
        assert value(samples, "roundhouse:disk_kv_deadline_hits_total", model="a") == 4
        counters = model_load(manager, slot)["counters"]  # /v1/load and /stats
        assert (counters["disk_kv_skipped"], counters["disk_kv_deadline_hits"]) == (7, 4)

    run(scenario, "a")


def test_one_model_only_and_no_created_series() -> None:
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        await manager.load(manager.slots["a"])
        everything, _ = scrape(metrics)
        assert {dict(labels)["model"] for _, labels in everything} == {"a", "b"}
        only_b, types = scrape(metrics, "b")
        assert {dict(labels)["model"] for _, labels in only_b} == {"b"}
        assert set(LLAMACPP_TYPES) <= set(types)
        assert not [name for name, _ in everything if name.endswith("_created")]
        assert b"_created" not in metrics.render()
        # A model a reload adds has all its series, at zero, from the next scrape on.
        manager.slots["c"] = ModelSlot(CatalogEntry("c", Path("/models/c"), "hf"))
        added, _ = scrape(metrics, "c")
        assert value(added, "roundhouse:requests_total", model="c", outcome="ok") == 0
        assert value(added, "llamacpp:tokens_predicted_total", model="c") == 0
        assert value(added, "roundhouse:model_state", model="c", state="unloaded") == 1

    run(scenario, "a", "b")


# ---- router-side counters and histograms -------------------------------------------


def finished(metrics: ServerMetrics, outcome: str, *, model: str | None = "a",
             status: int = 200, code: str | None = None) -> None:
    record = RequestRecord(model=model, outcome=outcome, status=status, error_code=code)
    metrics.router.request_started(record)
    metrics.router.request_finished(record)


def test_requests_by_outcome_and_reason() -> None:
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        finished(metrics, "ok")
        finished(metrics, "ok")
        finished(metrics, "rejected", status=400, code="invalid_value")
        finished(metrics, "rejected", status=429, code="server_overloaded")
        finished(metrics, "error", status=503, code="engine_failed")
        finished(metrics, "cancelled", status=499)
        # Refused before a model was chosen: on a router, model "".
        finished(metrics, "rejected", model=None, status=404, code="model_not_found")
        samples, _ = scrape(metrics)
        outcomes = {o: value(samples, "roundhouse:requests_total", model="a", outcome=o)
                    for o in ("ok", "rejected", "error", "cancelled")}
        assert outcomes == {"ok": 2, "rejected": 2, "error": 1, "cancelled": 1}
        assert value(samples, "roundhouse:requests_rejected_total", model="a",
                     reason="server_overloaded") == 1
        assert value(samples, "roundhouse:requests_failed_total", model="a",
                     reason="engine_failed") == 1
        assert value(samples, "roundhouse:requests_rejected_total", model="",
                     reason="model_not_found") == 1
        # Untouched models start at zero.
        assert value(samples, "roundhouse:requests_total", model="b", outcome="ok") == 0

    run(scenario, "a", "b")


def test_a_single_model_server_counts_every_request_as_its_models() -> None:
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        finished(metrics, "rejected", model=None, status=400, code=None)
        samples, _ = scrape(metrics)
        assert value(samples, "roundhouse:requests_total", model="solo", outcome="rejected") == 1
        assert value(samples, "roundhouse:requests_rejected_total", model="solo",
                     reason="http_400") == 1

    run(scenario, "solo", single=True)


def test_a_single_model_server_serves_llamacpp_series_without_a_model_label() -> None:
    """As llama-server does: dashboards built for it query llamacpp:* bare."""
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        await manager.load(manager.slots["solo"])
        FakeEngine.started[0].client.stats = EngineStats(
            prompt_tokens_total=30, cached_tokens_total=12, generated_tokens_total=7)
        for model in (None, "solo"):
            samples, types = scrape(metrics, model)
            assert {name: types.get(name) for name in LLAMACPP_TYPES} == LLAMACPP_TYPES
            assert value(samples, "llamacpp:tokens_predicted_total") == 7
            assert value(samples, "llamacpp:prompt_tokens_cached_total") == 12
            assert not any(name.startswith("llamacpp:") and labels
                           for name, labels in samples)
            # Roundhouse's own series keep theirs.
            assert value(samples, "roundhouse:prompt_tokens_cached_total", model="solo") == 12

    run(scenario, "solo", single=True)


def buckets(samples: Samples, name: str, model: str) -> dict[str, float]:
    return {dict(labels)["le"]: v for (sample, labels), v in samples.items()
            if sample == name + "_bucket" and dict(labels)["model"] == model}


def test_time_to_first_token_and_inter_token_latency_histograms() -> None:
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        record = RequestRecord(model="a", arrived=100.0)
        observer = metrics.router
        observer.request_started(record)
        observer.tokens_generated(record, 1, 100.3)
        observer.tokens_generated(record, 1, 100.33)
        # Two tokens in one batch after 20 ms: 10 ms each.
        observer.tokens_generated(record, 2, 100.35)
        record.outcome, record.status = "ok", 200
        observer.request_finished(record)
        samples, _ = scrape(metrics)
        ttft = buckets(samples, "roundhouse:time_to_first_token_seconds", "a")
        assert ttft["0.25"] == 0 and ttft["0.5"] == 1 and ttft["+Inf"] == 1
        assert value(samples, "roundhouse:time_to_first_token_seconds_sum", model="a") == (
            pytest.approx(0.3))
        itl = buckets(samples, "roundhouse:inter_token_latency_seconds", "a")
        assert (itl["0.005"], itl["0.01"], itl["0.02"], itl["0.04"]) == (0, 2, 2, 3)
        assert value(samples, "roundhouse:inter_token_latency_seconds_count", model="a") == 3
        assert value(samples, "roundhouse:inter_token_latency_seconds_sum", model="a") == (
            pytest.approx(0.05))
        # A new request's first token is a first token again, not a gap.
        second = RequestRecord(model="a", arrived=200.0)
        observer.tokens_generated(second, 1, 200.01)
        samples, _ = scrape(metrics)
        assert value(samples, "roundhouse:time_to_first_token_seconds_count", model="a") == 2
        assert value(samples, "roundhouse:inter_token_latency_seconds_count", model="a") == 3

    run(scenario, "a")


def test_lifecycle_events_count_and_time_transitions() -> None:
    async def scenario(manager: ModelManager, metrics: ServerMetrics) -> None:
        observer = metrics.router
        observer.model_event("a", "load", 7.0)
        observer.model_event("a", "sleep", 0.2)
        observer.model_event("a", "wake", 0.3)
        observer.model_event("a", "wake", 3.0)
        observer.model_event("a", "unload", 0.1)
        observer.model_event("a", "fail", 0.0)
        samples, _ = scrape(metrics)
        counts = {kind: value(samples, f"roundhouse:model_{kind}s_total", model="a")
                  for kind in ("load", "sleep", "wake", "unload")}
        assert counts == {"load": 1, "sleep": 1, "wake": 2, "unload": 1}
        assert value(samples, "roundhouse:engine_failures_total", model="a") == 1
        load = buckets(samples, "roundhouse:model_load_seconds", "a")
        assert (load["5.0"], load["10.0"]) == (0, 1)
        wake = buckets(samples, "roundhouse:model_wake_seconds", "a")
        assert (wake["0.25"], wake["0.5"], wake["2.5"], wake["5.0"]) == (0, 1, 1, 2)

    run(scenario, "a")
