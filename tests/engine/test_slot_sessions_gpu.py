"""llama.cpp's /slots save and restore on CUDA (bf16, our kernels, CUDA
graphs): a slot file holds the very bytes of the device pages, or of the
page-locked host tier's slots (engine/execution/page_bytes.py,
engine/execution/host_kv.py), laid out (layers, k/v, page, kv heads, head
dim); a restore puts them back bit for bit, and a follow-up request then
gives the greedy tokens of the same follow-up served by a device hit
before the save (the same chunks computed over the same K/V), in this engine
and after a restart (tests/engine/test_slot_sessions.py on CUDA).

The follow-up adds fewer than a page of tokens, so the only full pages it
can reuse are the session's: every run compared computes the same chunk,
on the same lane.
Run on the lent GPU: pytest -m gpu this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.slot_files import read_slot_file
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import step_outputs
from tests.engine.test_host_kv_tier_gpu import PAGE, prompt, qwen3_bf16
from tests.engine.test_slot_sessions import slot_action

pytestmark = pytest.mark.gpu
__all__ = ["qwen3_bf16"]  # the module's fixture, shared

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V) of some pages, on the host


def make_engine(model: Path, **overrides: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    options: dict[str, object] = {
        "device": "cuda", "dtype": "bfloat16", "page_size": PAGE, "max_concurrency": 2,
        "max_batched_tokens": 128, "kv_capacity_tokens": 1024, "output_window": 16,
        **overrides}
    core, events = in_process.make_engine(model, **options)
    assert core.runner.graphs is not None and core.runner.graphs.captured
    return core, events


def generate(core: EngineCore, events: list[p.EngineEvent], request_id: str, tokens: list[int],
             id_slot: int = -1) -> tuple[list[int], p.CacheHits | None]:
    """(greedy tokens, where its cached prompt tokens came from)."""
    events.clear()
    params = p.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    core.handle(p.Generate(request_id, tokens, params, id_slot))
    while core.has_work:
        core.step()
        core.scheduler.check_invariants()
    outputs = [o for o in step_outputs(events) if o.request_id == request_id]
    assert outputs and outputs[-1].finish_reason is not None, events
    hits = [o.cache_hits for o in outputs if o.cache_hits is not None]
    return [t for o in outputs for t in o.token_ids], hits[0] if hits else None


def chain(core: EngineCore, tokens: list[int]) -> list[bytes]:
    """The hashes of tokens' full pages."""
    kv, parent, hashes = core.scheduler.kv, ROOT_HASH, []
    for index in range(len(tokens) // PAGE):
        parent = hash_page(parent, tokens[index * PAGE : (index + 1) * PAGE], kv.fingerprint)
        hashes.append(parent)
    return hashes


def device_kv(core: EngineCore, hashes: list[bytes]) -> KV:
    """The K/V of the device pages holding these hashes, copied to the host."""
    by_hash = core.scheduler.kv.pool._by_hash
    assert all(h in by_hash for h in hashes), "a page is not on the device"
    pages = [by_hash[h] for h in hashes]
    return [(k[pages].cpu(), v[pages].cpu()) for k, v in core.runner.kv_caches]


def assert_file_holds(core: EngineCore, path: Path, expected: KV) -> None:
    """The file's pages are expected's bytes, laid out as a host tier slot's."""
    actions = core.slot_actions
    saved = read_slot_file(path, model_digest=actions.model_digest,
                           format_digest=actions.kv_format, page_size=PAGE,
                           page_bytes=actions.page_bytes)
    assert len(saved.pages) == expected[0][0].shape[0]
    k0 = expected[0][0]
    for index, payload in enumerate(saved.pages):
        page = torch.frombuffer(bytearray(payload), dtype=k0.dtype).reshape(
            len(expected), 2, *k0.shape[1:])
        for layer, (k, v) in enumerate(expected):
            assert torch.equal(page[layer, 0], k[index]) and torch.equal(page[layer, 1], v[index])


def assert_same_kv(got: KV, expected: KV) -> None:
    for (k, v), (k_expected, v_expected) in zip(got, expected, strict=True):
        assert torch.equal(k, k_expected) and torch.equal(v, v_expected)


def test_a_slot_restored_on_cuda_holds_its_bytes_and_gives_the_device_hits_tokens(
        qwen3_bf16: Path, tmp_path: Path) -> None:
    conversation = prompt(1, 6 * PAGE)
    follow_up = conversation + prompt(2, 12)
    core, events = make_engine(qwen3_bf16)
    generate(core, events, "turn-1", conversation, id_slot=1)
    hashes = chain(core, conversation)
    original = device_kv(core, hashes)
    path = tmp_path / "chat.bin"
    saved = slot_action(core, events, "save", 1, path)
    assert saved.error == "" and saved.num_tokens == len(conversation) + 16
    assert_file_holds(core, path, original)

    # The reference: the follow-up served by the session's pages on the device.
    expected, hits = generate(core, events, "device-hit", follow_up, id_slot=0)
    assert hits == p.CacheHits(device=len(conversation))

    # Erased (both lanes' pages), restored into the other lane: the same bytes.
    for lane in (0, 1):
        assert slot_action(core, events, "erase", lane).error == ""
    assert not any(h in core.scheduler.kv.pool._by_hash for h in hashes)
    restored = slot_action(core, events, "restore", 0, path)
    assert restored.error == "" and restored.num_tokens == saved.num_tokens
    assert_same_kv(device_kv(core, hashes), original)
    again, hits = generate(core, events, "restored", follow_up, id_slot=0)
    assert again == expected and hits == p.CacheHits(device=len(conversation))

    # A restart: a new engine of the same model restores the file.
    fresh, fresh_events = make_engine(qwen3_bf16)
    assert slot_action(fresh, fresh_events, "restore", 1, path).error == ""
    assert_same_kv(device_kv(fresh, hashes), original)
    after_restart, hits = generate(fresh, fresh_events, "restored", follow_up, id_slot=0)
    assert after_restart == expected and hits == p.CacheHits(device=len(conversation))


def test_a_slot_saved_from_the_page_locked_host_tier_holds_the_pages_bytes(
        qwen3_bf16: Path, tmp_path: Path) -> None:
    """The session's pages were pushed out to the host tier before the save:
    the file takes them from the host slots, and a restore brings them back."""
    # 32 device pages: one 300-token prompt fits, three do not.
    core, events = make_engine(qwen3_bf16, kv_capacity_tokens=512, host_kv_mib=64)
    assert core.runner.host_kv is not None and core.runner.host_kv.pinned
    conversation = prompt(1, 18 * PAGE)
    follow_up = conversation + prompt(2, 12)
    generate(core, events, "turn-1", conversation, id_slot=1)
    hashes = chain(core, conversation)
    original = device_kv(core, hashes)
    expected, hits = generate(core, events, "device-hit", follow_up, id_slot=0)
    assert hits == p.CacheHits(device=len(conversation))

    # Other prompts, on lane 0 (lane 1 keeps the session), push it to the host.
    for seed in (3, 4, 5):
        generate(core, events, f"other-{seed}", prompt(seed), id_slot=0)
    host = core.scheduler.kv.host
    assert host is not None
    assert not any(h in core.scheduler.kv.pool._by_hash for h in hashes)
    assert set(hashes) <= set(host.cached_hashes())
    path = tmp_path / "chat.bin"
    assert slot_action(core, events, "save", 1, path).error == ""
    assert_file_holds(core, path, original)

    # Erased from the host tier too, then restored from the file.
    assert slot_action(core, events, "erase", 1).error == ""
    assert not set(hashes) & set(host.cached_hashes())
    assert slot_action(core, events, "restore", 1, path).error == ""
    assert_same_kv(device_kv(core, hashes), original)
    again, hits = generate(core, events, "restored", follow_up, id_slot=0)
    assert again == expected and hits == p.CacheHits(device=len(conversation))
