"""--kv-dtype fp8 on the CPU (the reference ops quantize and dequantize in
torch): the pool holds float8 e4m3 at half the bytes of bf16, the first
layer's K/V are exactly e4m3 of what a bf16 pool holds, greedy tokens follow
bf16's (within its top 5 after any divergence), and every consumer of the
pool's bytes (host tier, sleep, page copies, slot files, the disk tier's
directory) moves fp8 pages as they are and never mixes them with bf16 ones.
tests/engine/test_fp8_kv_gpu.py does the engine on CUDA with our kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution.kv_dtype import FP8_KV, check_fp8_supported, kv_torch_dtype
from engine.execution.page_bytes import read_pages, write_pages
from engine.execution.page_copy import copy_page_prefixes
from engine.kv.partial_pages import PageCopy
from engine.process.bootstrap import build_engine
from engine.scheduling.core import EngineCore
from kernels.reference import quantize_fp8
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.engine.test_host_kv_tier import SMALL_POOL, evict, page_hashes, prompt, run
from tests.engine.test_slot_sessions import generate, slot_action

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# bf16 weights on the CPU too, so "bf16" and "fp8" differ only in the pool.
BF16 = {**SMALL_POOL, "dtype": "bfloat16", "kv_capacity_tokens": 256}


def make_engine(model: Path, kv_dtype: str, **overrides: object
                ) -> tuple[EngineCore, list[p.EngineEvent]]:
    return in_process.make_engine(model, **{**BF16, "kv_dtype": kv_dtype, **overrides})


def make_engine_and_ready(model: Path, kv_dtype: str, **overrides: object
                          ) -> tuple[EngineCore, list[p.EngineEvent], p.Ready]:
    events: list[p.EngineEvent] = []
    launch = p.EngineOptions(**{**BF16, "kv_dtype": kv_dtype, **overrides})  # type: ignore[arg-type]
    core, ready = build_engine(model, launch, lambda fraction, message: None, events.append)
    return core, events, ready


def device_pages(core: EngineCore, tokens: list[int]) -> list[int]:
    by_hash = core.scheduler.kv.pool._by_hash
    return [by_hash[h] for h in page_hashes(core, tokens)]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == FP8_KV else tensor


def test_kv_dtype_resolves_and_fp8_needs_an_op_that_reads_it() -> None:
    assert kv_torch_dtype("bf16", torch.float32) == torch.float32
    assert kv_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="--kv-dtype must be one of bf16, fp8"):
        kv_torch_dtype("int8", torch.bfloat16)
    check_fp8_supported("fp8", torch.device("cpu"), torch.float32, use_kernels=False)
    check_fp8_supported("fp8", torch.device("cuda", 0), torch.bfloat16, use_kernels=True)
    check_fp8_supported("bf16", torch.device("cuda", 0), torch.float16, use_kernels=False)
    with pytest.raises(ValueError, match=r"--kv-dtype fp8 on cuda:0 is read by our CUDA "
                                         r"kernels, .* \(this one: torch.float16\)"):
        check_fp8_supported("fp8", torch.device("cuda", 0), torch.float16, use_kernels=False)


def test_the_fp8_pool_halves_the_bytes_and_holds_e4m3_of_the_bf16_values(
        tiny_qwen3_dir: Path) -> None:
    conversation = prompt(1)
    plain, plain_events, ready_bf16 = make_engine_and_ready(tiny_qwen3_dir, "bf16")
    core, events, ready_fp8 = make_engine_and_ready(tiny_qwen3_dir, "fp8")
    assert ready_fp8.kv.bytes_per_token * 2 == ready_bf16.kv.bytes_per_token
    assert ready_fp8.kv.num_pages == ready_bf16.kv.num_pages  # the same --kv-capacity
    assert ready_fp8.memory.kv_bytes * 2 == ready_bf16.memory.kv_bytes
    assert {t.dtype for layer in core.runner.kv_caches for t in layer} == {FP8_KV}
    run(plain, plain_events, "bf16", conversation)
    run(core, events, "fp8", conversation)
    # The first layer's K/V come from the embeddings alone, the same in both
    # engines: the fp8 pool holds their e4m3 (scale 1.0) bit for bit.
    bf16_pages = device_pages(plain, conversation)
    fp8_pages = device_pages(core, conversation)
    for bf16_cache, fp8_cache in zip(plain.runner.kv_caches[0], core.runner.kv_caches[0],
                                     strict=True):
        expected = quantize_fp8(bf16_cache[bf16_pages], 1.0)
        assert torch.equal(fp8_cache[fp8_pages].view(torch.uint8), expected.view(torch.uint8))


def test_auto_sizing_gives_an_fp8_pool_twice_the_tokens(tiny_qwen3_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kv import kv_sizing

    # The CPU budget is a share of the available memory: fixed here, so both
    # engines get the same bytes.
    class Memory:
        available = 4 * 2**20
        total = 64 * 2**30

    monkeypatch.setattr(kv_sizing.psutil, "virtual_memory", lambda: Memory)
    options = {"kv_capacity_tokens": -1, "max_context": 256}
    _, _, ready_bf16 = make_engine_and_ready(tiny_qwen3_dir, "bf16", **options)
    _, _, ready_fp8 = make_engine_and_ready(tiny_qwen3_dir, "fp8", **options)
    assert ready_fp8.kv.num_pages == 2 * ready_bf16.kv.num_pages


def first_tokens(core: EngineCore, events: list[p.EngineEvent], tokens: list[int],
                 count: int) -> list[tuple[int, list[int]]]:
    """(greedy token, the top 5 there) of the first count output tokens."""
    params = p.SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = step_outputs(run_to_completion(core, events, {"r": (tokens, params)}))
    steps = [(token, logprobs.top_ids) for o in outputs
             for token, logprobs in zip(o.token_ids, o.logprobs or [], strict=True)
             if logprobs is not None]
    assert len(steps) == count
    return steps


def test_fp8_greedy_tokens_follow_bf16_and_stay_in_its_top_5(tiny_qwen3_dir: Path) -> None:
    plain, plain_events = make_engine(tiny_qwen3_dir, "bf16")
    core, events = make_engine(tiny_qwen3_dir, "fp8")
    agreed = []
    for seed in (1, 2, 3, 4):
        tokens = prompt(seed)
        reference = first_tokens(plain, plain_events, tokens, 8)
        fp8 = first_tokens(core, events, tokens, 8)
        same = next((i for i, (a, b) in enumerate(zip(reference, fp8, strict=True)) if a[0] != b[0]), 8)
        agreed.append(same)
        if same < 8:
            # Past a divergence the contexts differ: only its first token is compared.
            assert fp8[same][0] in reference[same][1], (seed, same)
    # A random tiny model's distributions are nearly flat; still most prompts
    # start alike (measured: 3, 5, 8 and 3 tokens).
    assert sum(agreed) >= 8, agreed


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_next", "qwen3_5"])
def test_every_architecture_serves_an_fp8_pool(tiny_model_factory, arch: str) -> None:
    # The hybrids' gated attention layers write and read the fp8 pages too.
    model = tiny_model_factory(arch)
    plain, plain_events = make_engine(model, "bf16")
    core, events = make_engine(model, "fp8")
    for seed in (1, 2):
        reference = first_tokens(plain, plain_events, prompt(seed), 4)
        fp8 = first_tokens(core, events, prompt(seed), 4)
        same = next((i for i, (a, b) in enumerate(zip(reference, fp8, strict=True))
                     if a[0] != b[0]), 4)
        if same < 4:
            assert fp8[same][0] in reference[same][1], (seed, same)


def test_host_tier_and_sleep_move_fp8_pages_bit_for_bit(tiny_qwen3_dir: Path) -> None:
    conversation = prompt(1)
    scratch, scratch_events = make_engine(tiny_qwen3_dir, "fp8")
    expected, _ = run(scratch, scratch_events, "scratch", conversation)

    core, events = make_engine(tiny_qwen3_dir, "fp8", host_kv_mib=1,
                               kv_capacity_tokens=128)
    assert core.runner.host_kv is not None and core.runner.host_kv.dtype == FP8_KV
    assert run(core, events, "first", conversation) == (expected, 0)
    evict(core, events, conversation)
    tokens, cached = run(core, events, "again", conversation)
    assert (tokens, cached) == (expected, 48)  # every full page back from the host

    pages = core.scheduler.kv.pool.cached_pages()
    before = [[as_bytes(t)[pages].clone() for t in layer] for layer in core.runner.kv_caches]
    core.handle(p.Sleep(weights="host"))
    core.handle(p.Wake())
    for layer, kept in zip(core.runner.kv_caches, before, strict=True):
        for cache, saved in zip(layer, kept, strict=True):
            assert cache.dtype == FP8_KV and torch.equal(as_bytes(cache)[pages], saved)


def test_page_copies_and_page_bytes_keep_fp8_bytes() -> None:
    shape = (4, 8, 2, 16)
    generator = torch.Generator().manual_seed(0)
    caches = [tuple(quantize_fp8(torch.randn(shape, generator=generator), 1.0) for _ in "kv")
              for _ in range(2)]
    copy_page_prefixes([PageCopy(1, 3, 5)], caches)  # type: ignore[arg-type]
    for layer in caches:
        for cache in layer:
            raw = cache.view(torch.uint8)
            assert torch.equal(raw[3, :5], raw[1, :5])
    payloads = read_pages(caches, [0, 1])  # type: ignore[arg-type]
    assert len(payloads[0]) == 2 * 2 * 8 * 2 * 16  # one byte an element
    write_pages(caches, [2, 3], payloads)  # type: ignore[arg-type]
    for layer in caches:
        for cache in layer:
            raw = cache.view(torch.uint8)
            assert torch.equal(raw[2:4], raw[0:2])


def test_a_bf16_slot_file_is_refused_by_an_fp8_engine(tiny_qwen3_dir: Path,
                                                      tmp_path: Path) -> None:
    conversation = prompt(1)
    plain, plain_events = make_engine(tiny_qwen3_dir, "bf16")
    generate(plain, plain_events, "turn", conversation, id_slot=0)
    path = tmp_path / "session.bin"
    saved = slot_action(plain, plain_events, "save", 0, path)
    assert not saved.error

    core, events = make_engine(tiny_qwen3_dir, "fp8")
    reply = slot_action(core, events, "restore", 0, path)
    assert "another KV format" in reply.error
    # Its own format restores.
    fp8_path = tmp_path / "fp8.bin"
    generate(core, events, "turn", conversation, id_slot=0)
    saved_fp8 = slot_action(core, events, "save", 0, fp8_path)
    assert not saved_fp8.error and saved_fp8.num_tokens == saved.num_tokens
    assert saved_fp8.num_bytes < saved.num_bytes  # the same pages at one byte an element
    assert not slot_action(core, events, "restore", 1, fp8_path).error


def test_the_disk_tier_keeps_fp8_pages_in_a_directory_of_their_own(
        tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    tiers = {}
    for kv_dtype in ("bf16", "fp8"):
        core, _ = make_engine(tiny_qwen3_dir, kv_dtype, host_kv_mib=1,
                              disk_kv_path=str(tmp_path), disk_kv_mib=1)
        tiers[kv_dtype] = core.scheduler.kv.disk
    bf16, fp8 = tiers["bf16"], tiers["fp8"]
    assert bf16 is not None and fp8 is not None
    # DIR/<model artifact>/<KV format>/: the same model, another format.
    assert bf16.directory.parent == fp8.directory.parent
    assert bf16.directory != fp8.directory and bf16.kv_format != fp8.kv_format
    assert fp8.page_bytes * 2 == bf16.page_bytes
