"""Routed experts in host memory (--expert-residency host, --n-cpu-moe) on the CPU.

On the CPU device the experts are in host memory either way, so these tests
check the plumbing: which layers are flagged host-resident, that both
checkpoint layouts fill them, that the engine's tokens do not change, what
the memory facts report, and that a sleep's weight stash leaves them alone.
tests/engine/test_moe_models_gpu.py checks on a GPU that they really are
page-locked host tensors beside a device-resident rest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution import model_runner
from engine.execution.device_state import (
    WeightStash,
    device_tensors,
    host_resident_tensors,
    model_tensors,
)
from engine.loader import load_model
from engine.models.moe import SparseMoE
from engine.process.bootstrap import build_engine
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.engine.test_loaders import assert_same_weights
from tests.engine.test_moe_gguf import write_moe_gguf

CPU = torch.device("cpu")
# The tiny Qwen3-MoE's sparse layers (decoder_sparse_step 2, mlp_only_layers [3]).
SPARSE = (1, 5)


def host_layers(model: torch.nn.Module) -> list[int]:
    return [index for index, layer in enumerate(model.layers)
            if isinstance(layer.mlp, SparseMoE) and layer.mlp.host_resident]


@pytest.mark.parametrize(("host_expert_layers", "expected"),
                         [(0, []), (-1, [1, 5]), (2, [1]), (5, [1]), (6, [1, 5]), (99, [1, 5])])
def test_the_first_n_layers_or_all_keep_their_experts_on_the_host(
        tiny_model_factory, host_expert_layers: int, expected: list[int]) -> None:
    loaded = load_model(tiny_model_factory("qwen3_moe"), CPU, torch.float32,
                        host_expert_layers=host_expert_layers)
    assert host_layers(loaded.model) == expected
    names = set(host_resident_tensors(loaded.model))
    # The experts only: the router, attention and dense layers stay with the device.
    assert names == {f"layers.{layer}.mlp.{weight}" for layer in expected
                     for weight in ("gate_up_weight", "down_weight")}
    assert set(device_tensors(loaded.model)) == set(model_tensors(loaded.model)) - names
    assert loaded.model.host_expert_layers == host_expert_layers


@pytest.mark.parametrize(("arch", "host_expert_layers", "message"), [
    ("qwen3", -1, r"--expert-residency host \(--cpu-moe\): Qwen3ForCausalLM has no experts"),
    ("qwen3", 4, "--n-cpu-moe 4: Qwen3ForCausalLM has no experts"),
    ("qwen3_moe", 1, "--n-cpu-moe 1: Qwen3MoeForCausalLM has no experts in its first 1 layers"),
])
def test_host_residency_that_would_move_nothing_is_refused(
        tiny_model_factory, arch: str, host_expert_layers: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(tiny_model_factory(arch), CPU, torch.float32,
                   host_expert_layers=host_expert_layers)


def test_per_expert_and_stacked_checkpoints_fill_host_resident_experts(
        tiny_model_factory, tmp_path: Path) -> None:
    hf_dir = tiny_model_factory("qwen3_moe_all_sparse")
    reference = load_model(hf_dir, CPU, torch.float32).model
    gguf_file = write_moe_gguf(hf_dir, tmp_path / "moe.gguf", "qwen3_moe")
    for source in (hf_dir, gguf_file):  # experts.E.* slices; ffn_*_exps stacks
        loaded = load_model(source, CPU, torch.float32, host_expert_layers=-1).model
        assert host_layers(loaded) == list(range(len(loaded.layers)))
        assert_same_weights(loaded, reference)


def tokens_and_memory(model: Path, **options: object) -> tuple[dict[str, list[int]],
                                                               p.MemoryFacts]:
    events: list[p.EngineEvent] = []
    launch = p.EngineOptions(page_size=8, max_batched_tokens=24, max_concurrency=3,
                             kv_capacity_tokens=512, **options)  # type: ignore[arg-type]
    core, ready = build_engine(model, launch, lambda fraction, message: None, events.append)
    params = p.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(10, 150000, (17 + 9 * i,), generator=generator).tolist()
               for i in range(3)}
    outputs = step_outputs(run_to_completion(core, events, {rid: (ids, params)
                                                            for rid, ids in prompts.items()}))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for output in outputs:
        tokens[output.request_id].extend(output.token_ids)
    return tokens, ready.memory


def test_engine_tokens_and_memory_facts_with_experts_on_the_host(tiny_model_factory) -> None:
    model = tiny_model_factory("qwen3_moe")
    expected, device_only = tokens_and_memory(model)
    assert device_only.host_weights_bytes == 0
    # One sparse layer's stacks: gate_up [8, 64, 64] and down [8, 64, 32], float32.
    layer_bytes = (8 * 64 * 64 + 8 * 64 * 32) * 4
    for options, host_bytes in (({"expert_residency": "host"}, 2 * layer_bytes),
                                ({"host_expert_layers": 2}, layer_bytes)):
        tokens, memory = tokens_and_memory(model, **options)
        assert tokens == expected and all(tokens.values())
        assert memory.host_weights_bytes == host_bytes
        # Counted once, on the host side: the device's weights lack them.
        assert memory.weights_bytes == device_only.weights_bytes - host_bytes
        assert memory.footprint_bytes == device_only.footprint_bytes - host_bytes


def test_weight_stash_leaves_host_resident_experts_where_they_are(tiny_model_factory) -> None:
    model = load_model(tiny_model_factory("qwen3_moe"), CPU, torch.float32,
                       host_expert_layers=-1).model
    before = {name: t.clone() for name, t in model_tensors(model).items()}
    experts = host_resident_tensors(model)
    storage = {name: t.data_ptr() for name, t in experts.items()}
    on_device = device_tensors(model)
    device_bytes = sum(t.nbytes for t in on_device.values())
    stash = WeightStash(model, pin=False)
    # Neither copied into the stash nor freed: the stash holds the device's
    # weights only (each rounded up to 512 bytes).
    assert device_bytes <= stash.nbytes < device_bytes + 512 * len(on_device)
    after_sleep = model_tensors(model)
    for name, tensor in after_sleep.items():
        if name in experts:
            assert tensor.data_ptr() == storage[name] and torch.equal(tensor, before[name]), name
        else:
            assert tensor.numel() == 0, name
    stash.put_back(model, CPU)
    for name, tensor in model_tensors(model).items():
        assert torch.equal(tensor, before[name]), name
    assert {name: t.data_ptr() for name, t in host_resident_tensors(model).items()} == storage


def test_a_disk_sleep_reloads_the_experts_into_host_memory_again(
        tiny_model_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model_factory("qwen3_moe")
    reloads: list[torch.nn.Module] = []

    def load_and_keep(*args: object, **kwargs: object) -> object:
        loaded = load_model(*args, **kwargs)  # type: ignore[arg-type]
        reloads.append(loaded.model)
        return loaded

    monkeypatch.setattr(model_runner, "load_model", load_and_keep)
    core, events = in_process.make_engine(model, page_size=8, max_batched_tokens=24,
                                          max_concurrency=3, kv_capacity_tokens=512,
                                          host_expert_layers=2)
    runner = core.runner
    before = {name: t.clone() for name, t in model_tensors(runner.model).items()}
    core.handle(p.Sleep(weights="disk"))
    assert all(t.numel() == 0 for t in model_tensors(runner.model).values())
    core.handle(p.Wake())
    assert any(isinstance(e, p.Awake) for e in events), events
    # The reload placed the experts as the load had (on a GPU: in host memory).
    assert len(reloads) == 1 and host_layers(reloads[0]) == [1]
    assert host_layers(runner.model) == [1]
    for name, tensor in model_tensors(runner.model).items():
        assert torch.equal(tensor, before[name]), name
