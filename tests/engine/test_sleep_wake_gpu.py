"""Sleep and wake on CUDA: the device memory really goes back (reserved bytes
drop by at least the weights plus the KV pool), host copies are page-locked,
and a woken engine gives the same greedy tokens from the same prefix cache.

The model is a small random-weight Qwen3 in bfloat16, built here with
transformers, so the test needs no fixture from a registry.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution.device_state import DroppedWeights, model_tensors
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs

pytestmark = pytest.mark.gpu

KV_TOKENS = 65536


@pytest.fixture(scope="module")
def qwen3_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rope_theta=1_000_000.0, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=151643, eos_token_id=151645,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    target = tmp_path_factory.mktemp("qwen3-bf16")
    model.save_pretrained(target, safe_serialization=True)
    return target


def make_engine(model: Path) -> tuple[EngineCore, list[p.EngineEvent]]:
    # The device memory of the tests before, which the byte counts below
    # must not see: engines of other test modules still in reference
    # cycles hold blocks in the allocator's segments, so a sleep could not
    # give those segments back (in an engine process nothing else lives
    # there), and their cached free blocks would let a wake succeed that
    # needs more memory than is free. (Seen in a full GPU run, 2026-12-02.)
    gc.collect()
    torch.cuda.empty_cache()
    return in_process.make_engine(model, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=4,
                                  max_batched_tokens=256, kv_capacity_tokens=KV_TOKENS)


def run(core: EngineCore, events: list[p.EngineEvent], request_id: str,
        tokens: list[int]) -> tuple[list[int], int]:
    """(generated tokens, prompt tokens served from the prefix cache)."""
    params = p.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = step_outputs(run_to_completion(core, events, {request_id: (tokens, params)}))
    return [t for o in outputs for t in o.token_ids], outputs[-1].num_cached_tokens


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 150000, (length,), generator=generator).tolist()


def last(events: list[p.EngineEvent], kind: type) -> object:
    assert events and isinstance(events[-1], kind), events
    return events[-1]


@pytest.mark.parametrize("weights", ["host", "disk"])
def test_sleep_returns_device_memory_and_wake_gives_the_same_tokens(
    qwen3_bf16: Path, weights: str
) -> None:
    core, events = make_engine(qwen3_bf16)
    runner = core.runner
    # One token past a page boundary: 18 whole pages are the cache hit.
    conversation = prompt(1, 18 * 16 + 1)
    run(core, events, "warm", conversation)
    # Compare a prefix-cache hit with a prefix-cache hit: in bfloat16 a
    # recomputed prefix may round differently from a cached one.
    expected, cached = run(core, events, "again", conversation)
    run(core, events, "other", prompt(2, 100))
    assert cached == 288
    weights_bytes = sum(t.nbytes for t in model_tensors(runner.model).values())
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    torch.cuda.synchronize()
    reserved_awake = torch.cuda.memory_reserved()

    events.clear()
    core.handle(p.Sleep(weights=weights))  # type: ignore[arg-type]
    slept = last(events, p.Slept)
    assert isinstance(slept, p.Slept)
    reserved_asleep = torch.cuda.memory_reserved()
    assert slept.device_bytes == reserved_asleep
    assert slept.kept_pages == core.scheduler.kv.pool.num_cached >= 24
    assert reserved_awake - reserved_asleep >= weights_bytes + kv_bytes, (
        f"reserved {reserved_awake} -> {reserved_asleep}; weights {weights_bytes}, KV {kv_bytes}")
    sleeping = runner._sleeping
    assert sleeping is not None
    assert sleeping.kv._buffer.tensors[0].is_pinned()
    if weights == "host":
        assert all(t.is_pinned() for t in sleeping.weights._buffer.tensors)  # type: ignore[union-attr]
    else:
        assert isinstance(sleeping.weights, DroppedWeights)

    events.clear()
    core.handle(p.Wake())
    assert isinstance(last(events, p.Awake), p.Awake)
    assert torch.cuda.memory_reserved() >= weights_bytes + kv_bytes
    assert all(t.is_cuda and t.numel() for t in model_tensors(runner.model).values())
    assert run(core, events, "after", conversation) == (expected, cached)
    # And a request the cache has never seen works as well.
    assert len(run(core, events, "new", prompt(3, 50))[0]) == 16


def test_out_of_memory_while_waking_is_raised(qwen3_bf16: Path) -> None:
    core, events = make_engine(qwen3_bf16)
    run(core, events, "warm", prompt(4, 100))
    core.handle(p.Sleep(weights="host"))
    free, _ = torch.cuda.mem_get_info()
    # Leave far less than the weights and KV pool need (about 230 MiB).
    hog = torch.empty(free - 64 * 2**20, dtype=torch.uint8, device="cuda")
    try:
        # Engine-wide: the busy loop lets it through, engine/process/main.py reports EngineDead.
        with pytest.raises(torch.OutOfMemoryError):
            core.handle(p.Wake())
    finally:
        del hog
        torch.cuda.empty_cache()
