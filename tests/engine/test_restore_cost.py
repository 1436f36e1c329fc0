"""The disk restore's cost model (engine/kv/restore_cost.py): a restore goes
ahead until both rates are measured, then only where reading is expected to
beat computing by the margin, but for one probe in PROBE_EVERY; the
estimates follow the rates as they change."""

from __future__ import annotations

import math

import pytest

from engine.kv.restore_cost import (
    PROBE_EVERY,
    READ_HALF_LIFE_BYTES,
    RESTORE_MARGIN,
    DecayingCost,
    RestoreCost,
)

MB = 10**6
# A returning prefix: 1,000 tokens of 150 KB each (the 8B shape's K/V).
TOKENS = 1000
BYTES = TOKENS * 150_000


def measured(read_bytes_per_s: float, prefill_tokens_per_s: float) -> RestoreCost:
    cost = RestoreCost()
    cost.note_read(int(read_bytes_per_s), 1.0)
    cost.note_prefill(int(prefill_tokens_per_s), 1.0)
    return cost


def verdicts(cost: RestoreCost, count: int) -> list[bool]:
    return [cost.should_restore(BYTES, TOKENS) for _ in range(count)]


def test_until_both_rates_are_measured_every_restore_goes_ahead() -> None:
    cost = RestoreCost()
    assert verdicts(cost, 3 * PROBE_EVERY) == [True] * 3 * PROBE_EVERY
    # A disk far slower than computing, but the prefill rate not known yet.
    cost.note_read(1 * MB, 1.0)
    assert verdicts(cost, 3 * PROBE_EVERY) == [True] * 3 * PROBE_EVERY
    only_prefill = RestoreCost()
    only_prefill.note_prefill(40_000, 1.0)
    assert only_prefill.should_restore(BYTES, TOKENS)
    # Empty samples (a step without prompt tokens) measure nothing.
    cost = RestoreCost()
    cost.note_read(1 * MB, 1.0)
    cost.note_prefill(0, 0.5)
    cost.note_prefill(100, 0.0)
    assert not cost.prefill.measured and cost.should_restore(BYTES, TOKENS)


def test_a_disk_slower_than_computing_is_skipped_and_a_faster_one_restored() -> None:
    # The H200's figures: 0.9 GB/s read, 30k tokens/s (4.5 GB/s of K/V) computed.
    slow = measured(900 * MB, 30_000)
    assert slow.restore_seconds(BYTES) == pytest.approx(BYTES / (900 * MB))
    assert slow.compute_seconds(TOKENS) == pytest.approx(TOKENS / 30_000)
    assert not slow.should_restore(BYTES, TOKENS)
    # A disk at 9 GB/s against the same prefill.
    assert measured(9000 * MB, 30_000).should_restore(BYTES, TOKENS)


def test_close_calls_go_to_computing() -> None:
    compute_bytes_per_s = 30_000 * BYTES / TOKENS  # the prefill's rate, in K/V bytes
    # Reading a little faster than computing, within the margin: computed.
    assert not measured(1.1 * compute_bytes_per_s, 30_000).should_restore(BYTES, TOKENS)
    assert not measured(0.99 * RESTORE_MARGIN * compute_bytes_per_s, 30_000).should_restore(
        BYTES, TOKENS)
    assert measured(1.01 * RESTORE_MARGIN * compute_bytes_per_s, 30_000).should_restore(
        BYTES, TOKENS)


def test_every_nth_restore_judged_slower_goes_ahead_to_measure_again() -> None:
    cost = measured(900 * MB, 30_000)
    probe = [False] * (PROBE_EVERY - 1) + [True]
    assert verdicts(cost, 3 * PROBE_EVERY) == probe * 3
    # A verdict "faster" in between starts the count again.
    cost = measured(900 * MB, 30_000)
    assert verdicts(cost, PROBE_EVERY - 1) == [False] * (PROBE_EVERY - 1)
    assert cost.should_restore(1, TOKENS)  # one byte to read: faster
    assert verdicts(cost, PROBE_EVERY) == probe


def test_the_read_estimate_follows_a_disk_that_gets_faster_and_slower_again() -> None:
    # Long measured slow (files not in the page cache): each restore reads
    # 270 MB before its 300 ms deadline.
    cost = measured(900 * MB, 30_000)
    for _ in range(20):
        cost.note_read(270 * MB, 0.3)
    assert not cost.should_restore(BYTES, TOKENS)
    # A probe finds the files in the page cache: a 16k-token prefix (2.4 GB)
    # read at 20 GB/s. Its weight is its size, many half-lives: one is enough.
    cost.note_read(2400 * MB, 2400 / 20_000)
    assert cost.reads.rate == pytest.approx(20_000 * MB, rel=0.05)
    assert cost.should_restore(BYTES, TOKENS)
    # Evicted from the page cache again: the restores (all going ahead now)
    # read 150 MB before their deadline; the first turns the verdict.
    cost.note_read(150 * MB, 0.3)
    assert not cost.should_restore(BYTES, TOKENS)
    for _ in range(12):
        cost.note_read(150 * MB, 0.3)
    assert cost.reads.rate == pytest.approx(500 * MB, rel=0.1)


def test_the_prefill_estimate_follows_a_gpu_that_gets_busier() -> None:
    cost = measured(1500 * MB, 30_000)
    assert not cost.should_restore(BYTES, TOKENS)  # 1.5 GB/s against 4.5 GB/s computed
    # Other requests' decode rows take the steps' time: prompts compute at
    # 5k tokens/s (0.75 GB/s of K/V), slower than the disk reads.
    for _ in range(160):  # 5 half-lives
        cost.note_prefill(2048, 2048 / 5_000)
    assert cost.prefill.rate == pytest.approx(5_000, rel=0.05)
    assert cost.should_restore(BYTES, TOKENS)


def test_a_restore_that_read_nothing_by_its_deadline_makes_the_disk_slow() -> None:
    cost = RestoreCost()
    cost.note_prefill(30_000, 1.0)
    cost.note_read(0, 0.3)
    assert cost.reads.measured and math.isinf(cost.restore_seconds(BYTES))
    assert not cost.should_restore(BYTES, TOKENS)
    # A probe that reads fast outweighs it.
    cost.note_read(4 * READ_HALF_LIFE_BYTES, 4 * READ_HALF_LIFE_BYTES / (20_000 * MB))
    assert cost.should_restore(BYTES, TOKENS)


def test_samples_weigh_by_their_size_not_their_time() -> None:
    # A time-weighted mean of 1 s at 100 MB/s and 0.01 s at 10 GB/s would be
    # ~100 MB/s; by size (100 MB each), the cost per byte is their mean.
    estimate = DecayingCost(half_life=1e12)
    estimate.add(100 * MB, 1.0)
    estimate.add(100 * MB, 0.01)
    assert estimate.per_unit == pytest.approx((1.0 + 0.01) / (200 * MB), rel=1e-6)
    assert DecayingCost(half_life=1.0).per_unit == 0.0 and not DecayingCost(1.0).measured
