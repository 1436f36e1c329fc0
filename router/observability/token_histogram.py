"""A histogram cheap enough to observe once per streamed token.

prometheus_client's Histogram takes a lock twice and walks its buckets in
Python for every observation. The inter-token latency is observed for every
token of every stream, tens of thousands of times a second under load, in
the event loop, which is also this histogram's only writer. So this one keeps
plain counts, finds the bucket by bisection, and exposes at scrape time
exactly what a prometheus_client Histogram of the same name, help text, label
and buckets exposes (less its `_created` samples, which /metrics drops).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class HistogramSeries:
    """One label value's buckets (per bucket, not cumulative) and sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self._bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        """As prometheus_client's Histogram.observe: the sum takes every
        amount, the first bucket whose bound is at least the amount counts it
        (a NaN, which no bound is at least, is counted in none)."""
        self.sum += amount
        bounds = self._bounds
        index = bisect_left(bounds, amount)
        if index < len(bounds) and amount <= bounds[index]:
            self.counts[index] += 1.0


class TokenHistogram:
    """A histogram with one label, registered in `registry` like a
    prometheus_client Histogram; `labels(value)` is its series for a value."""

    def __init__(self, name: str, documentation: str, label: str, buckets: Sequence[float],
                 registry: CollectorRegistry):
        bounds = [float(bound) for bound in buckets]
        if bounds != sorted(bounds):
            raise ValueError("buckets must be in increasing order")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name = name
        self.documentation = documentation
        self.label = label
        self._bounds = tuple(bounds)
        self._bucket_names = [floatToGoString(bound) for bound in bounds]
        self._series: dict[str, HistogramSeries] = {}
        registry.register(self)

    def labels(self, value: str) -> HistogramSeries:
        series = self._series.get(value)
        if series is None:
            series = self._series[value] = HistogramSeries(self._bounds)
        return series

    def describe(self) -> list[Metric]:
        """The family without samples, so that the registry knows its names."""
        return [HistogramMetricFamily(self.name, self.documentation, labels=[self.label])]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, series in self._series.items():
            cumulative, total = [], 0.0
            for bucket, count in zip(self._bucket_names, series.counts, strict=True):
                total += count
                cumulative.append((bucket, total))
            family.add_metric([value], cumulative, series.sum)
        yield family
