"""KV pool sizing: from what the lanes can use, within the memory given."""

from __future__ import annotations

import pytest

from engine.kv.kv_sizing import KV_FILL, KV_FROM_NEED, plan_kv
from protocol import EngineOptions

COMMON = dict(page_size=16, bytes_per_token=1000, trained_context=40960, requested_context=8192,
              max_concurrency=8)


def test_by_default_the_pool_holds_what_the_lanes_can_use_and_no_more() -> None:
    plan = plan_kv(**COMMON, requested_capacity=KV_FROM_NEED, device_budget_bytes=10**12)
    assert plan.capacity_tokens == 8 * 8192 and plan.max_context == 8192


def test_the_prefix_cache_share_adds_to_the_need() -> None:
    plan = plan_kv(**COMMON, requested_capacity=KV_FROM_NEED, prefix_cache_tokens=16_000,
                   device_budget_bytes=10**12)
    assert plan.capacity_tokens == 8 * 8192 + 16_000


def test_fill_takes_all_the_memory_given() -> None:
    plan = plan_kv(**COMMON, requested_capacity=KV_FILL, device_budget_bytes=10**9)
    assert plan.num_pages == 10**9 // 16_000


def test_need_is_cut_to_the_budget_and_the_context_follows_when_below_one_context() -> None:
    plan = plan_kv(**COMMON, requested_capacity=KV_FROM_NEED, device_budget_bytes=16_000 * 300)
    assert plan.capacity_tokens == 4800 and plan.max_context == 4800


def test_on_the_cpu_need_caps_the_pool_too() -> None:
    plan = plan_kv(page_size=16, bytes_per_token=100, trained_context=2048, requested_context=0,
                   requested_capacity=KV_FROM_NEED, max_concurrency=2)
    assert plan.capacity_tokens == 2 * 2048


def test_engine_options_refuse_meaningless_capacities() -> None:
    assert EngineOptions(kv_capacity_tokens=-1).kv_capacity_tokens == KV_FILL
    with pytest.raises(ValueError, match="KV capacity"):
        EngineOptions(kv_capacity_tokens=-2)
    with pytest.raises(ValueError, match="device memory"):
        EngineOptions(device_memory_mib=-1)
