"""A mixture-of-experts model through the GPU path (bf16, CudaOps, CUDA graphs).

Routing runs our kernel and the experts the expert GEMV (decode-sized steps)
or the grouped GEMM (larger ones), inside the CUDA graphs
(engine/execution/model_ops.py). These tests check that path: graphs on give
the tokens of graphs off, the first tokens are among transformers' best, and
host-resident experts (with and without the device expert cache) give the
tokens of device-resident ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.support import fixtures

pytestmark = pytest.mark.gpu

TEXT = ("Roundhouses, circular buildings with a turntable at their centre, let engineers store "
        "and service many locomotives in a small yard. ")


@pytest.fixture(scope="module")
def qwen3_moe_gpu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    target = tmp_path_factory.mktemp("qwen3-moe-gpu")
    config = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
        mlp_only_layers=[0], max_position_embeddings=4096, rope_theta=1_000_000.0,
        initializer_range=0.1, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    source = fixtures.qwen3_tokenizer()
    for name in fixtures.QWEN3_TOKENIZER_FILES:
        (target / name).write_bytes((source / name).read_bytes())
    return target


def _tokens(path: Path, cuda_graph: bool, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    core, events = in_process.make_engine(
        path, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=8,
        max_batched_tokens=64, kv_capacity_tokens=16384, cuda_graph=cuda_graph)
    params = p.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = step_outputs(run_to_completion(core, events, {rid: (ids, params)
                                                            for rid, ids in prompts.items()}))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for output in outputs:
        tokens[output.request_id].extend(output.token_ids)
    return tokens


def test_graphs_on_give_the_tokens_of_graphs_off(qwen3_moe_gpu: Path) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(qwen3_moe_gpu)(TEXT * 3)["input_ids"]
    prompts = {f"r{i}": ids[: 20 + 17 * i] for i in range(5)}
    eager = _tokens(qwen3_moe_gpu, cuda_graph=False, prompts=prompts)
    graphed = _tokens(qwen3_moe_gpu, cuda_graph=True, prompts=prompts)
    assert all(len(t) == 24 for t in eager.values())
    assert graphed == eager


def test_first_tokens_among_transformers_top5(qwen3_moe_gpu: Path) -> None:
    """bf16 rounding may part ours from transformers' at a near-tie, so each
    prompt's first token must be among transformers' five best (bf16, GPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(qwen3_moe_gpu)(TEXT * 3)["input_ids"]
    prompts = {f"r{i}": ids[: 20 + 17 * i] for i in range(5)}
    ours = _tokens(qwen3_moe_gpu, cuda_graph=True, prompts=prompts)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_moe_gpu, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        for rid, prompt in prompts.items():
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1]
            assert ours[rid][0] in logits.topk(5).indices.tolist(), rid


# ---- routed experts in host memory (--expert-residency host, --n-cpu-moe) ----------


def test_host_resident_experts_are_pinned_host_tensors_beside_a_device_rest(
        qwen3_moe_gpu: Path) -> None:
    from engine.execution.device_state import (
        WeightStash,
        device_tensors,
        host_resident_tensors,
        model_tensors,
    )
    from engine.loader import load_model

    cuda = torch.device("cuda")
    model = load_model(qwen3_moe_gpu, cuda, torch.bfloat16, host_expert_layers=-1).model
    experts = host_resident_tensors(model)
    # mlp_only_layers [0]: layers 1..3 are sparse; their routers stay on the device.
    assert set(experts) == {f"layers.{layer}.mlp.{weight}" for layer in (1, 2, 3)
                            for weight in ("gate_up_weight", "down_weight")}
    assert all(t.device.type == "cpu" and t.is_pinned() for t in experts.values())
    assert all(t.is_cuda for t in device_tensors(model).values())
    # The loader filled them as it fills device-resident ones.
    reference = model_tensors(load_model(qwen3_moe_gpu, cuda, torch.bfloat16).model)
    for name, tensor in model_tensors(model).items():
        assert torch.equal(tensor.cpu(), reference[name].cpu()), name
    del reference

    # A sleep's stash copies the device's weights only: the experts stay put.
    storage = {name: t.data_ptr() for name, t in experts.items()}
    stash = WeightStash(model, pin=True)
    assert all(t.numel() == 0 for t in device_tensors(model).values())
    after = host_resident_tensors(model)
    assert {name: t.data_ptr() for name, t in after.items()} == storage
    assert all(t.is_pinned() and t.numel() for t in after.values())
    stash.put_back(model, cuda)
    assert all(t.is_cuda and t.numel() for t in device_tensors(model).values())
    assert {name: t.data_ptr() for name, t in host_resident_tensors(model).items()} == storage


@pytest.mark.parametrize("options", [{"expert_residency": "host"}, {"host_expert_layers": 2},
                                     {"expert_residency": "host", "expert_cache_mib": 3}],
                         ids=["all-layers", "first-2-layers", "all-layers-cached"])
def test_host_resident_experts_give_the_tokens_of_device_resident_ones(
        qwen3_moe_gpu: Path, options: dict[str, object]) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(qwen3_moe_gpu)(TEXT * 3)["input_ids"]
    prompts = {f"r{i}": ids[: 20 + 17 * i] for i in range(5)}
    # 40 tokens: some 45 forward passes a run, past the expert cache's second
    # refresh (every 16), the first one that moves experts in.
    params = p.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def tokens_and_memory(**extra: object) -> tuple[dict[str, list[int]], p.MemoryFacts,
                                                    dict[str, list[int]]]:
        from engine.process.bootstrap import build_engine

        events: list[p.EngineEvent] = []
        launch = p.EngineOptions(device="cuda", dtype="bfloat16", page_size=16,
                                 max_concurrency=8, max_batched_tokens=64,
                                 kv_capacity_tokens=16384, **extra)  # type: ignore[arg-type]
        core, ready = build_engine(qwen3_moe_gpu, launch, lambda fraction, message: None,
                                   events.append)
        runs = []
        for _ in range(2):  # before and after a sleep that keeps the weights in host memory
            outputs = step_outputs(run_to_completion(core, events, {
                rid: (prompt, params) for rid, prompt in prompts.items()}))
            tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
            for output in outputs:
                tokens[output.request_id].extend(output.token_ids)
            runs.append(tokens)
            if extra.get("expert_cache_mib"):
                # Five of each layer's 16 experts fit 3 MiB: the GEMV read
                # cached experts on the device and the rest over the bus (a
                # wake makes a new cache).
                cache = core.runner.expert_cache
                assert cache is not None and cache.slots_per_layer == 5 and cache.swaps > 0
            core.handle(p.Sleep(weights="host"))
            core.handle(p.Wake())
        return runs[0], ready.memory, runs[1]

    # The run after the wake reuses the first run's prefixes (a cache hit
    # computes the rest in other chunks, which round apart in bf16): it is
    # compared with the device-resident run after its own wake.
    expected, device_memory, expected_after_wake = tokens_and_memory()
    got, memory, after_wake = tokens_and_memory(**options)
    assert got == expected and after_wake == expected_after_wake
    assert memory.host_weights_bytes > 0
    assert memory.weights_bytes == device_memory.weights_bytes - memory.host_weights_bytes
