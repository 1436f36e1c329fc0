"""The device cache of host-resident experts (engine/execution/expert_cache.py):
its policy and copies, run on CPU tensors (the GPU's kernels read it:
tests/engine/test_moe_models_gpu.py checks the tokens there)."""

from __future__ import annotations

import pytest
import torch

from engine.execution import expert_cache
from engine.execution.expert_cache import ExpertCache, LayerCache
from engine.loader import load_model
from engine.models.moe import SparseMoE

CPU = torch.device("cpu")


@pytest.fixture
def host_moe(tiny_model_factory) -> torch.nn.Module:
    # The tiny Qwen3-MoE's sparse layers are 1 and 5; all host-resident.
    return load_model(tiny_model_factory("qwen3_moe"), CPU, torch.float32,
                      host_expert_layers=-1).model


def layers_of(model: torch.nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def expert_bytes(layer: SparseMoE) -> int:
    return (layer.gate_up_weight[0].numel() + layer.down_weight[0].numel()) * 4


def pick(cache: LayerCache, counts: dict[int, int]) -> None:
    """Route counts[e] tokens to expert e (one slot each)."""
    ids = [expert for expert, n in counts.items() for _ in range(n)]
    cache.count(torch.tensor(ids).reshape(-1, 1))


def run_steps(cache: ExpertCache, steps: int) -> None:
    for _ in range(steps):
        cache.step()


def assert_consistent(layer: LayerCache) -> None:
    """The slot table names each held expert's slot, whose copy is the expert."""
    table = layer.view.slots.tolist()
    for slot, expert in enumerate(layer.holds):
        if expert < 0:
            continue
        assert table[expert] == slot
        assert torch.equal(layer.view.gate_up[slot], layer.module.gate_up_weight[expert])
        assert torch.equal(layer.view.down[slot], layer.module.down_weight[expert])
    assert sum(1 for s in table if s >= 0) == sum(1 for e in layer.holds if e >= 0)


def test_the_most_picked_experts_of_each_layer_move_to_the_device(host_moe) -> None:
    modules = layers_of(host_moe)
    cache = ExpertCache(host_moe, 3 * len(modules) * expert_bytes(modules[0]), CPU)
    assert cache.slots_per_layer == 3
    assert [layer.module for layer in cache.layers] == modules
    assert all(module.expert_cache is layer for module, layer in zip(modules, cache.layers,
                                                                      strict=True))
    first, second = cache.layers
    pick(first, {0: 9, 2: 7, 5: 5, 6: 1})
    pick(second, {3: 4})
    # The first refresh queues the counts' read; the next one acts on them.
    run_steps(cache, expert_cache.REFRESH_STEPS)
    assert first.holds == [-1, -1, -1]
    run_steps(cache, expert_cache.REFRESH_STEPS)
    assert sorted(first.holds) == [0, 2, 5]
    assert second.holds.count(3) == 1 and second.holds.count(-1) == 2
    for layer in cache.layers:
        assert_consistent(layer)
    assert cache.swaps == 4


def test_a_hotter_expert_displaces_the_coldest_and_old_use_fades(host_moe) -> None:
    modules = layers_of(host_moe)
    cache = ExpertCache(host_moe, 2 * len(modules) * expert_bytes(modules[0]), CPU)
    layer = cache.layers[0]
    pick(layer, {1: 8, 4: 6})
    run_steps(cache, 2 * expert_cache.REFRESH_STEPS)
    assert sorted(layer.holds) == [1, 4]
    # Counts halve at each refresh: expert 7, now picked more, takes 4's slot.
    pick(layer, {7: 12, 1: 8})
    run_steps(cache, 2 * expert_cache.REFRESH_STEPS)
    assert sorted(layer.holds) == [1, 7]
    assert_consistent(layer)


def test_swaps_per_refresh_are_bounded(host_moe, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expert_cache, "MAX_SWAPS", 3)
    modules = layers_of(host_moe)
    cache = ExpertCache(host_moe, 4 * len(modules) * expert_bytes(modules[0]), CPU)
    for layer in cache.layers:
        pick(layer, {0: 4, 1: 3, 2: 2, 3: 1})
    run_steps(cache, expert_cache.REFRESH_STEPS)
    cache.refresh()
    # Three copies, taken in turn over the layers, most picked first.
    assert cache.swaps == 3
    assert sorted(cache.layers[0].holds) == [-1, -1, 0, 1]
    assert sorted(cache.layers[1].holds) == [-1, -1, -1, 0]
    for layer in cache.layers:
        assert_consistent(layer)


def test_a_budget_below_one_expert_per_layer_caches_nothing(host_moe) -> None:
    modules = layers_of(host_moe)
    cache = ExpertCache(host_moe, len(modules) * expert_bytes(modules[0]) - 1, CPU)
    assert cache.layers == [] and all(module.expert_cache is None for module in modules)
    run_steps(cache, 3 * expert_cache.REFRESH_STEPS)  # nothing to do, no error


def test_release_detaches_the_cache_from_the_layers(host_moe) -> None:
    modules = layers_of(host_moe)
    cache = ExpertCache(host_moe, 2 * len(modules) * expert_bytes(modules[0]), CPU)
    assert cache.nbytes > 0
    cache.release()
    assert all(module.expert_cache is None for module in modules)
    assert cache.nbytes == 0


def test_a_counted_layer_computes_what_an_uncounted_one_does(host_moe) -> None:
    """On the CPU the reference ops ignore the cache: counting routes nothing
    differently (the GPU test compares tokens with the kernels reading it)."""
    modules = layers_of(host_moe)
    hidden = torch.randn(5, host_moe.config.hidden_size)
    from engine.execution.model_ops import REFERENCE_OPS

    plain = modules[0](hidden, REFERENCE_OPS)
    cache = ExpertCache(host_moe, 2 * len(modules) * expert_bytes(modules[0]), CPU)
    counted = modules[0](hidden, REFERENCE_OPS)
    assert torch.equal(plain, counted)
    # Five tokens, k picks each.
    assert int(cache.layers[0].usage.sum()) == 5 * modules[0].moe.experts_per_token
