"""--kv-dtype fp8 on CUDA: our kernels write and read float8 e4m3 pages
(tests/kernels/test_fp8_kv_gpu.py checks them one by one), the pool holds
twice the tokens of a bf16 pool in the same memory, CUDA graphs replay the
same tokens as eager steps, greedy tokens follow a bf16 pool's (within its
top 5 at any divergence), and the host tier moves fp8 pages bit for bit.
The model is the small random-weight Qwen3 of test_host_kv_tier_gpu.py
(bf16, head size 64). Run on the lent GPU: pytest -m gpu this file.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.engine.test_host_kv_tier_gpu import PAGE, evict, prompt, qwen3_bf16, run

pytestmark = pytest.mark.gpu
__all__ = ["qwen3_bf16"]  # the module's fixture, shared

OPTIONS: dict[str, object] = {"device": "cuda", "dtype": "bfloat16", "page_size": PAGE,
                              "max_concurrency": 2, "max_batched_tokens": 128,
                              "kv_capacity_tokens": 2048, "output_window": 16}
NEW_TOKENS = 16


def release(core: EngineCore) -> None:
    core.runner.sleep("disk", [])
    del core
    gc.collect()
    torch.cuda.empty_cache()


def greedy_with_top5(core: EngineCore, events: list[p.EngineEvent],
                     tokens: list[int]) -> list[tuple[int, list[int]]]:
    params = p.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                              logprobs=5)
    outputs = step_outputs(run_to_completion(core, events, {"r": (tokens, params)}))
    steps = [(token, logprobs.top_ids) for o in outputs
             for token, logprobs in zip(o.token_ids, o.logprobs or [], strict=True)
             if logprobs is not None]
    assert len(steps) == NEW_TOKENS
    return steps


def runs(model: Path, kv_dtype: str, **overrides: object) -> list[list[tuple[int, list[int]]]]:
    core, events = in_process.make_engine(model, **{**OPTIONS, "kv_dtype": kv_dtype,
                                                    **overrides})
    assert {t.dtype for layer in core.runner.kv_caches for t in layer} == {
        torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16}
    found = [greedy_with_top5(core, events, prompt(seed)) for seed in (1, 2, 3)]
    release(core)
    return found


def test_fp8_greedy_tokens_follow_bf16_and_graphs_replay_eager_steps(qwen3_bf16: Path) -> None:
    bf16 = runs(qwen3_bf16, "bf16")
    fp8 = runs(qwen3_bf16, "fp8")
    # Graphs and eager steps run the same kernels on the same fp8 pages.
    assert runs(qwen3_bf16, "fp8", cuda_graph=False) == fp8
    agreed = []
    for reference, quantized in zip(bf16, fp8, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(reference, quantized, strict=True))
                     if a[0] != b[0]), NEW_TOKENS)
        agreed.append(same)
        if same < NEW_TOKENS:
            # Past a divergence the contexts differ: only its first token is compared.
            assert quantized[same][0] in reference[same][1], agreed
    print(f"fp8 KV: greedy tokens equal to bf16 KV's for the first {agreed} of {NEW_TOKENS}")
    assert sum(agreed) >= NEW_TOKENS, agreed


def test_an_fp8_pool_holds_twice_the_tokens_in_the_same_memory(qwen3_bf16: Path) -> None:
    pools = {}
    for kv_dtype in ("bf16", "fp8"):
        ready, core = in_process.make_engine_and_ready(
            qwen3_bf16, **{**OPTIONS, "kv_dtype": kv_dtype, "kv_capacity_tokens": -1,
                           "device_memory_mib": 1024, "max_context": 2048})
        pools[kv_dtype] = ready
        release(core)
    bf16, fp8 = pools["bf16"], pools["fp8"]
    assert fp8.kv.bytes_per_token * 2 == bf16.kv.bytes_per_token
    assert 1.95 <= fp8.kv.num_pages / bf16.kv.num_pages <= 2.05, (fp8.kv, bf16.kv)
    assert abs(fp8.memory.kv_bytes - bf16.memory.kv_bytes) <= 0.03 * bf16.memory.kv_bytes


def test_the_host_tier_moves_fp8_pages_bit_for_bit(qwen3_bf16: Path) -> None:
    # test_host_kv_tier_gpu.py's case on an fp8 pool: a prefix restored from
    # the host tier holds the bytes computed at first and gives the tokens
    # of a device hit.
    core, events = in_process.make_engine(qwen3_bf16, **{**OPTIONS, "kv_dtype": "fp8",
                                                         "kv_capacity_tokens": 512,
                                                         "host_kv_mib": 64})
    assert core.runner.host_kv is not None and core.runner.host_kv.dtype == torch.float8_e4m3fn
    conversation = prompt(1, 18 * PAGE + 1)
    run(core, events, {"first": conversation})
    hit, cached = run(core, events, {"device-hit": conversation})["device-hit"]
    full_pages = (len(conversation) - 1) // PAGE
    assert cached == full_pages * PAGE
    pool = core.scheduler.kv.pool
    hashes = list(pool._by_hash)[:full_pages]
    pages = [pool._by_hash[h] for h in hashes]
    before = [[t.view(torch.uint8)[pages].clone() for t in layer]
              for layer in core.runner.kv_caches]
    evict(core, events, hashes)
    tokens, cached_again = run(core, events, {"restored": conversation})["restored"]
    assert tokens == hit and cached_again == cached
    pages = [pool._by_hash[h] for h in hashes]
    for layer, kept in zip(core.runner.kv_caches, before, strict=True):
        for cache, saved in zip(layer, kept, strict=True):
            assert torch.equal(cache.view(torch.uint8)[pages], saved)
    release(core)
