"""The prefix cache's host tier on CUDA: page-locked host slots, copies on a
side stream that the compute stream waits for, and restored pages that hold
the very bytes computed before and give the same greedy tokens.

The model is a small random-weight Qwen3 in bfloat16 (head size 64, so our
kernels and CUDA graphs run), built here with transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution.host_kv import HostKVPool
from engine.kv.host_tier import KVTransfers
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs

pytestmark = pytest.mark.gpu

PAGE = 16


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
    target = tmp_path_factory.mktemp("qwen3-bf16-host-kv")
    model.save_pretrained(target, safe_serialization=True)
    return target


def make_engine(model: Path) -> tuple[EngineCore, list[p.EngineEvent]]:
    # 32 device pages: one 300-token prompt fits, three do not.
    return in_process.make_engine(model, device="cuda", dtype="bfloat16", page_size=PAGE,
                                  max_concurrency=2, max_batched_tokens=128,
                                  kv_capacity_tokens=512, output_window=16, host_kv_mib=64)


def prompt(seed: int, length: int = 300) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 150000, (length,), generator=generator).tolist()


def greedy() -> p.SamplingParams:
    return p.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def run(core: EngineCore, events: list[p.EngineEvent],
        requests: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
    """Per request: (generated tokens, prompt tokens served from the cache)."""
    outputs = step_outputs(run_to_completion(
        core, events, {name: (tokens, greedy()) for name, tokens in requests.items()}))
    return {name: ([t for o in outputs if o.request_id == name for t in o.token_ids],
                   [o for o in outputs if o.request_id == name][-1].num_cached_tokens)
            for name in requests}


def test_host_slots_are_page_locked_and_copies_are_ordered_before_the_compute_stream() -> None:
    device = torch.device("cuda")
    layers, pages = 4, 64
    kv = [(torch.randn(pages, PAGE, 2, 64, device=device, dtype=torch.bfloat16),
           torch.randn(pages, PAGE, 2, 64, device=device, dtype=torch.bfloat16))
          for _ in range(layers)]
    pool = HostKVPool(32, num_layers=layers, page_size=PAGE, num_kv_heads=2, head_dim=64,
                      dtype=torch.bfloat16, device=device)
    assert pool.pinned and pool.slots.is_pinned()
    before = [(k[[3, 9, 10]].clone(), v[[3, 9, 10]].clone()) for k, v in kv]
    # The compute stream is busy when the copies are queued; a later kernel
    # on it must see them done.
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(8):
        busy = busy @ busy
    pool.run(KVTransfers(stores=[(3, 5), (9, 6), (10, 20)]), kv)
    for k, v in kv:
        k[[3, 9, 10]] = 0
        v[[3, 9, 10]] = 0
    pool.run(KVTransfers(loads=[(5, 40), (6, 41), (20, 63)]), kv)
    restored = [(k[[40, 41, 63]].clone(), v[[40, 41, 63]].clone()) for k, v in kv]
    torch.cuda.synchronize()
    for (k, v), (k_before, v_before) in zip(restored, before, strict=True):
        assert torch.equal(k, k_before) and torch.equal(v, v_before)
    pool.release()


def evict(core: EngineCore, events: list[p.EngineEvent], hashes: list[bytes]) -> None:
    """Other long prompts push the conversation's pages to the host."""
    run(core, events, {"a": prompt(2), "b": prompt(3)})
    run(core, events, {"c": prompt(4)})
    assert not any(h in core.scheduler.kv.pool._by_hash for h in hashes)


def assert_kv_unchanged(core: EngineCore, hashes: list[bytes],
                        kv_before: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The conversation's pages hold the bytes computed at first."""
    pages = [core.scheduler.kv.pool._by_hash[h] for h in hashes]
    for (k, v), (k_before, v_before) in zip(core.runner.kv_caches, kv_before, strict=True):
        assert torch.equal(k[pages], k_before) and torch.equal(v[pages], v_before)


def test_a_prefix_restored_on_cuda_matches_a_device_hit_bit_for_bit(qwen3_bf16: Path) -> None:
    core, events = make_engine(qwen3_bf16)
    tier = core.scheduler.kv.host
    assert tier is not None and core.runner.host_kv is not None and core.runner.host_kv.pinned
    # One token past a page boundary: the device hit then covers whole pages
    # only, as a restore from the tier does (a partial last page is reused on
    # the device alone), so both compute the same tokens.
    conversation = prompt(1, 18 * PAGE + 1)
    run(core, events, {"first": conversation})
    hit, cached = run(core, events, {"device-hit": conversation})["device-hit"]
    full_pages = (len(conversation) - 1) // PAGE
    assert cached == full_pages * PAGE
    pool = core.scheduler.kv.pool
    # The prompt's reusable pages, in order (registration order of the chain).
    hashes = list(pool._by_hash)[:full_pages]
    pages = [pool._by_hash[h] for h in hashes]
    kv_before = [(k[pages].clone(), v[pages].clone()) for k, v in core.runner.kv_caches]

    evict(core, events, hashes)
    hits = tier.counters.hit_pages
    tokens, cached_again = run(core, events, {"restored": conversation})["restored"]
    assert tokens == hit and cached_again == cached
    assert tier.counters.hit_pages - hits == full_pages
    assert_kv_unchanged(core, hashes, kv_before)

    # Again, restored while another request's steps are in flight.
    evict(core, events, hashes)
    events.clear()
    core.handle(p.Generate("beside", prompt(5, 40), greedy()))
    core.step()
    core.step()
    core.handle(p.Generate("joining", conversation, greedy()))
    while core.has_work:
        core.step()
        core.scheduler.check_invariants()
    finished = {o.request_id: o for o in step_outputs(events) if o.finish_reason is not None}
    assert set(finished) == {"beside", "joining"}
    assert finished["joining"].num_cached_tokens == cached
    # Each admission restores the whole prefix again: one more than the
    # first, or a few if page pressure preempted "joining" before its first
    # token and it was admitted again.
    restored = tier.counters.hit_pages - hits
    assert restored >= 2 * full_pages and restored % full_pages == 0
    assert_kv_unchanged(core, hashes, kv_before)
