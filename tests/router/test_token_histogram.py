"""The inter-token latency histogram exposes what prometheus_client's
Histogram would for the same observations."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from router.observability.metrics import INTER_TOKEN_BUCKETS
from router.observability.token_histogram import TokenHistogram

NAME = "roundhouse:inter_token_latency_seconds"


def exposed(registry: CollectorRegistry) -> list[str]:
    # /metrics drops the _created samples (metrics.py, _Exposed); so does this.
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_same_exposition_as_a_prometheus_histogram() -> None:
    reference_registry, registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(NAME, "Seconds between tokens.", ["model"], buckets=INTER_TOKEN_BUCKETS,
                          registry=reference_registry)
    ours = TokenHistogram(NAME, "Seconds between tokens.", "model", INTER_TOKEN_BUCKETS, registry)
    assert exposed(reference_registry) == exposed(registry)  # no series yet
    for model in ("b", "a", ""):  # series created at zero, in this order
        reference.labels(model)
        ours.labels(model)
    assert exposed(reference_registry) == exposed(registry)
    rng = random.Random(0)
    # Bounds exactly, between and past them, zero, negative, huge and NaN.
    special = [*INTER_TOKEN_BUCKETS, 0.0, -1.0, 1e9, math.nan]
    for _ in range(3000):
        model = rng.choice("ab")
        amount = rng.choice(special) if rng.random() < 0.3 else rng.random() * 3
        reference.labels(model).observe(amount)
        ours.labels(model).observe(amount)
    assert exposed(reference_registry) == exposed(registry)


def test_buckets_must_increase_and_end_at_infinity() -> None:
    with pytest.raises(ValueError):
        TokenHistogram("x", "y", "model", (0.1, 0.01), CollectorRegistry())
    histogram = TokenHistogram("x", "y", "model", (0.1, math.inf), CollectorRegistry())
    series = histogram.labels("m")
    series.observe(5.0)
    assert series.counts == [0.0, 1.0] and series.sum == 5.0


def test_a_name_registered_twice_is_refused() -> None:
    registry = CollectorRegistry()
    TokenHistogram("x", "y", "model", (0.1,), registry)
    with pytest.raises(ValueError):
        Histogram("x", "y", ["model"], registry=registry)
