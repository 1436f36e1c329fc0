"""GET /metrics: the per-app Prometheus registry and the router-side series.

Router-side events (requests, tokens as they stream, lifecycle transitions)
are counted as they happen by RouterMetrics, an observer of the manager's
Observers; the engine-derived series (llama.cpp's llamacpp: set and our
token counters) are built at scrape time by EngineCollector
(metric_collector.py). Each application has its own registry, never the
process-wide default one, so two servers in one process (the tests) never
share counts.

Every series carries a `model` label (the catalog id, never an alias), but
for llama.cpp's own (llamacpp:) on a single-model server, which carry none,
as llama-server's do. On a router, a request refused before it reached a
model (bad JSON, unknown model, /models/load of nothing) is labelled model="".
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest

from router.lifecycle import ModelManager
from router.observability.metric_collector import EngineCollector
from router.observability.records import Observers, RequestRecord
from router.observability.token_histogram import TokenHistogram

OUTCOMES = ("ok", "rejected", "error", "cancelled")

# Time to first token includes queueing and any load or wake, hence the long tail.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0,
                       2.5)
LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
WAKE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    """Counters and histograms of what the router sees happen: a
    RequestObserver and a ModelObserver (records.py)."""

    def __init__(self, registry: CollectorRegistry, *, unattributed_model: str = ""):
        # The label of requests that never reached a model: the one model of
        # a single-model server (every request is for it), else "".
        self._unattributed = unattributed_model
        self.requests = Counter("roundhouse:requests_total",
                                "API requests (POST/DELETE) by outcome: ok, rejected (refused: "
                                "4xx, overload), error (5xx, engine failure), cancelled (client left).",
                                ["model", "outcome"], registry=registry)
        # Keys are few and fixed by the operator, so their labels are a safe label.
        self.requests_by_key = Counter("roundhouse:requests_by_key_total",
                                       "API requests by the label of the API key used "
                                       "(cli-1, env-1, file-<label>; empty without keys) and outcome.",
                                       ["key", "outcome"], registry=registry)
        self.rejected = Counter("roundhouse:requests_rejected_total",
                                "Rejected requests by reason (the error code).",
                                ["model", "reason"], registry=registry)
        self.failed = Counter("roundhouse:requests_failed_total",
                              "Requests that failed on the server's side, by reason (the error code).",
                              ["model", "reason"], registry=registry)
        self.first_token = Histogram("roundhouse:time_to_first_token_seconds",
                                     "Seconds from a request's arrival to its first token.",
                                     ["model"], buckets=TTFT_BUCKETS, registry=registry)
        # Observed for every streamed token: a TokenHistogram, which costs a
        # fraction of a prometheus_client Histogram's observation.
        self.inter_token = TokenHistogram("roundhouse:inter_token_latency_seconds",
                                          "Seconds between a request's tokens, one observation "
                                          "per token after the first.",
                                          "model", INTER_TOKEN_BUCKETS, registry)
        self.transitions = {
            kind: Counter(f"roundhouse:model_{kind}s_total", help_text, ["model"], registry=registry)
            for kind, help_text in (
                ("load", "Model loads that reached Ready (engine processes started)."),
                ("wake", "Wakes of a sleeping model."),
                ("sleep", "Times the model was put to sleep."),
                ("unload", "Unloads (engine processes stopped on purpose)."),
            )
        }
        self.evictions = Counter("roundhouse:model_evictions_total",
                                 "Models put to sleep or unloaded to make room for another, by "
                                 "reason (device_memory, models_max).", ["model", "reason"],
                                 registry=registry)
        self.engine_failures = Counter("roundhouse:engine_failures_total",
                                       "Engines that failed to load or died; the model's next "
                                       "request starts a new one.", ["model"], registry=registry)
        self.load_seconds = Histogram("roundhouse:model_load_seconds",
                                      "Seconds from starting an engine to its Ready.",
                                      ["model"], buckets=LOAD_BUCKETS, registry=registry)
        self.wake_seconds = Histogram("roundhouse:model_wake_seconds",
                                      "Seconds to wake a sleeping model.",
                                      ["model"], buckets=WAKE_BUCKETS, registry=registry)
        # When each streaming request got its previous tokens, by record id.
        self._last_tokens: dict[str, float] = {}

    def start_model(self, model: str) -> None:
        """Create a model's series at zero, so that the first event shows as an
        increase (rate() and increase() need a sample before it)."""
        for outcome in OUTCOMES:
            self.requests.labels(model, outcome)
        for counter in (*self.transitions.values(), self.engine_failures):
            counter.labels(model)
        for histogram in (self.first_token, self.inter_token, self.load_seconds, self.wake_seconds):
            histogram.labels(model)

    def _model(self, record: RequestRecord) -> str:
        return record.model if record.model is not None else self._unattributed

    # ---- RequestObserver ---------------------------------------------------------

    def request_started(self, record: RequestRecord) -> None:
        pass

    def request_admitted(self, record: RequestRecord) -> None:
        pass

    def tokens_generated(self, record: RequestRecord, count: int, now: float) -> None:
        previous = self._last_tokens.get(record.id)
        self._last_tokens[record.id] = now
        if previous is None:
            self.first_token.labels(self._model(record)).observe(max(now - record.arrived, 0.0))
            return
        if count < 1:
            return
        # Tokens that arrive together shared the wait: each gets its part.
        gap = max(now - previous, 0.0) / count
        histogram = self.inter_token.labels(self._model(record))
        for _ in range(count):
            histogram.observe(gap)

    def request_finished(self, record: RequestRecord) -> None:
        self._last_tokens.pop(record.id, None)
        model = self._model(record)
        outcome = record.outcome if record.outcome in OUTCOMES else "error"
        self.requests.labels(model, outcome).inc()
        self.requests_by_key.labels(record.key_label or "", outcome).inc()
        reason = record.error_code or f"http_{record.status}"
        if outcome == "rejected":
            self.rejected.labels(model, reason).inc()
        elif outcome == "error":
            self.failed.labels(model, reason).inc()

    # ---- ModelObserver -------------------------------------------------------------

    def model_event(self, model: str, kind: str, seconds: float) -> None:
        if kind == "fail":
            self.engine_failures.labels(model).inc()
            return
        counter = self.transitions.get(kind)
        if counter is not None:
            counter.labels(model).inc()
        if kind == "load":
            self.load_seconds.labels(model).observe(seconds)
        elif kind == "wake":
            self.wake_seconds.labels(model).observe(seconds)

    def model_evicted(self, model: str, action: str, reason: str, for_model: str,
                      device: str | None) -> None:
        self.evictions.labels(model, reason).inc()


class _Exposed:
    """The registry as /metrics shows it: OpenMetrics-only `_created` samples
    dropped (llama.cpp has none), and optionally one model's series only."""

    def __init__(self, registry: CollectorRegistry, model: str | None, unlabelled: str = ""):
        self._registry = registry
        self._model = model
        # The model a sample without a `model` label belongs to (the single
        # model's bare llamacpp: series).
        self._unlabelled = unlabelled

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            samples = [s for s in family.samples if s.name != created
                       and (self._model is None
                            or s.labels.get("model", self._unlabelled) == self._model)]
            if samples:
                kept = copy.copy(family)
                kept.samples = samples
                yield kept


class ServerMetrics:
    """One application's metrics: its registry, the router-side observer and
    the engine collector."""

    def __init__(self, manager: ModelManager):
        self._manager = manager
        self.registry = CollectorRegistry()
        single = next(iter(manager.slots)) if manager.single else ""
        self._single = single
        self.router = RouterMetrics(self.registry, unattributed_model=single)
        self._started: set[str] = set()
        self._start_new_models()
        self.engines = EngineCollector(manager)
        self.registry.register(self.engines)

    def _start_new_models(self) -> None:
        # Models a reload added get their zeros at the next scrape.
        for model in self._manager.slots:
            if model not in self._started:
                self.router.start_model(model)
                self._started.add(model)

    def subscribe(self, observers: Observers) -> None:
        observers.requests.append(self.router)
        observers.models.append(self.router)

    def render(self, model: str | None = None) -> bytes:
        """The Prometheus text format (0.0.4): every model's series, or one's."""
        self._start_new_models()
        return generate_latest(_Exposed(self.registry, model, self._single))
