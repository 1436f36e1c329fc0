"""llama.cpp's /slots in the engine (CPU): lanes, id_slot pinning, and a
lane's session saved to a file and restored, in this engine or after a
restart, giving exactly the tokens computed from scratch; damaged or foreign
files refused before anything is allocated."""

from __future__ import annotations

from pathlib import Path

import pytest

import protocol as p
from engine.kv.slot_files import _HEADER, write_slot_file
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import step_outputs
from tests.engine.test_host_kv_tier import SMALL_POOL, greedy, on_device, page_hashes, prompt

POOL = {**SMALL_POOL, "kv_capacity_tokens": 256}


def make_engine(model: Path, **overrides: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    return in_process.make_engine(model, **{**POOL, **overrides})


def generate(core: EngineCore, events: list[p.EngineEvent], request_id: str, tokens: list[int],
             id_slot: int = -1, max_tokens: int = 8) -> tuple[list[int], int]:
    events.clear()
    core.handle(p.Generate(request_id, tokens, greedy(max_tokens), id_slot))
    while core.has_work:
        core.step()
        core.scheduler.check_invariants()
    outputs = [o for o in step_outputs(events) if o.request_id == request_id]
    assert outputs and outputs[-1].finish_reason is not None, events
    return [t for o in outputs for t in o.token_ids], outputs[-1].num_cached_tokens


def slot_action(core: EngineCore, events: list[p.EngineEvent], action: str, id_slot: int = -1,
                path: Path | None = None) -> p.SlotReply:
    events.clear()
    core.handle(p.SlotCommand("a1", action, id_slot, str(path or "")))  # type: ignore[arg-type]
    while core.has_work or core.slot_actions.deferred:
        if core.has_work:
            core.step()
        core.slot_actions.retry()
    (reply,) = [e for e in events if isinstance(e, p.SlotReply)]
    return reply


def test_a_restored_slot_gives_the_tokens_computed_from_scratch_also_after_a_restart(
        tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    conversation = prompt(1)
    follow_up = conversation + prompt(2, 12)
    plain, plain_events = make_engine(tiny_qwen3_dir)
    expected, cached = generate(plain, plain_events, "scratch", follow_up)
    assert cached == 0

    core, events = make_engine(tiny_qwen3_dir)
    first, _ = generate(core, events, "turn-1", conversation, id_slot=1)
    lanes = slot_action(core, events, "list").lanes
    assert [lane.id for lane in lanes] == [0, 1]
    assert lanes[1].token_ids == conversation + first and lanes[0].token_ids == []
    assert not lanes[1].is_processing and lanes[1].request_id == "turn-1"

    saved = slot_action(core, events, "save", 1, tmp_path / "chat.bin")
    assert saved.error == "" and saved.num_tokens == len(conversation) + len(first)
    assert saved.num_bytes == (tmp_path / "chat.bin").stat().st_size
    # 57 tokens computed (50 + 7 fed back): 7 full pages of 8 in the file.
    assert saved.num_bytes > 7 * 2 * 8 * 8

    # The same engine, its cache erased, then restored: reused again.
    erased = slot_action(core, events, "erase", 1)
    assert erased.num_tokens == saved.num_tokens
    assert not any(on_device(core, h) for h in page_hashes(core, conversation))
    restored = slot_action(core, events, "restore", 0, tmp_path / "chat.bin")
    assert restored.error == "" and restored.num_tokens == saved.num_tokens
    assert slot_action(core, events, "list").lanes[0].token_ids == conversation + first
    again, cached = generate(core, events, "turn-2", follow_up)
    # Six whole pages, and the two prompt tokens of the seventh (to the token).
    assert again == expected and cached == 50

    # A restart: a new engine of the same model finds the session in the file.
    fresh, fresh_events = make_engine(tiny_qwen3_dir)
    assert slot_action(fresh, fresh_events, "restore", 1, tmp_path / "chat.bin").error == ""
    after_restart, cached = generate(fresh, fresh_events, "turn-2", follow_up)
    assert after_restart == expected and cached == 50
    fresh.scheduler.check_invariants()


def test_a_restored_slot_is_reused_to_the_token(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """A prompt sharing the first half of a restored session's last full page
    reuses those tokens too (a partial hit), exactly."""
    session = prompt(1)
    core, events = make_engine(tiny_qwen3_dir)
    first, _ = generate(core, events, "turn-1", session, id_slot=0)
    assert slot_action(core, events, "save", 0, tmp_path / "chat.bin").error == ""
    slot_action(core, events, "erase", 0)
    assert slot_action(core, events, "restore", 1, tmp_path / "chat.bin").error == ""
    # 57 tokens computed: 7 full pages restored; the prompt shares 4 tokens
    # of the seventh, tokens 48..51.
    branch = (session + first)[:52] + prompt(3, 10)
    plain, plain_events = make_engine(tiny_qwen3_dir)
    expected, _ = generate(plain, plain_events, "scratch", branch)
    got, cached = generate(core, events, "branch", branch)
    assert got == expected and cached == 52
    hits = [o.cache_hits for o in step_outputs(events) if o.cache_hits is not None]
    assert hits == [p.CacheHits(device=48, partial=4)]
    core.scheduler.check_invariants()


def test_an_empty_session_saves_and_restores(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    saved = slot_action(core, events, "save", 0, tmp_path / "empty.bin")
    assert saved.error == "" and saved.num_tokens == 0
    restored = slot_action(core, events, "restore", 1, tmp_path / "empty.bin")
    assert restored.error == "" and restored.num_tokens == 0
    core.scheduler.check_invariants()


def _pool_state(core: EngineCore) -> tuple[int, int]:
    pool = core.scheduler.kv.pool
    return pool.num_free, pool.num_cached


@pytest.mark.parametrize("damage", ["flipped", "truncated", "longer", "other_model",
                                    "other_format", "not_a_slot_file", "missing"])
def test_a_damaged_or_foreign_slot_file_is_refused_and_allocates_nothing(
        tiny_qwen3_dir: Path, tmp_path: Path, damage: str) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    generate(core, events, "turn-1", prompt(1), id_slot=0)
    path = tmp_path / "chat.bin"
    assert slot_action(core, events, "save", 0, path).error == ""
    slot_action(core, events, "erase", 0)
    data = bytearray(path.read_bytes())
    actions = core.slot_actions
    if damage == "flipped":
        data[_HEADER.size + 400] ^= 1
        path.write_bytes(data)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "longer":
        path.write_bytes(data + b"\0")
    elif damage == "missing":
        path.unlink()
    elif damage == "not_a_slot_file":
        path.write_bytes(b"GGUF" + bytes(100))
    else:
        model = bytes(16) if damage == "other_model" else actions.model_digest
        kv_format = bytes(16) if damage == "other_format" else actions.kv_format
        write_slot_file(path, model_digest=model, format_digest=kv_format, page_size=8,
                        page_bytes=actions.page_bytes, token_ids=list(range(16)),
                        pages=[bytes(actions.page_bytes)] * 2)
    before = _pool_state(core)
    reply = slot_action(core, events, "restore", 0, path)
    expected = {"flipped": "checksum", "truncated": "truncated", "longer": "trailing",
                "other_model": "another model", "other_format": "another KV format",
                "not_a_slot_file": "not a Roundhouse slot file", "missing": "does not exist"}
    assert expected[damage] in reply.error and "chat.bin" in reply.error
    assert _pool_state(core) == before
    assert slot_action(core, events, "list").lanes[0].token_ids == []
    core.scheduler.check_invariants()


def test_id_slot_pins_a_request_to_its_lane_which_it_waits_for(tiny_qwen3_dir: Path) -> None:
    core, _ = make_engine(tiny_qwen3_dir)
    core.handle(p.Generate("long", prompt(1), greedy(12), 0))
    core.step()
    core.handle(p.Generate("pinned", prompt(2), greedy(2), 0))
    core.handle(p.Generate("free", prompt(3), greedy(2)))
    core.step()
    lanes = core.scheduler.lanes
    # "free" took lane 1; "pinned" waits for lane 0 although the engine has room.
    assert [lane.running.request_id if lane.running else None for lane in lanes.lanes] == [
        "long", "free"]
    assert [seq.request_id for seq in core.scheduler.waiting] == ["pinned"]
    while core.has_work:
        core.step()
    assert lanes.lanes[0].request_id == "pinned" and lanes.lanes[1].request_id == "free"


def test_an_id_slot_outside_the_lanes_is_a_request_error(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    core.handle(p.Generate("r", prompt(1), greedy(2), 5))
    (error,) = [e for e in events if isinstance(e, p.RequestError)]
    assert "Invalid slot ID" in error.message
    assert slot_action(core, events, "save", 2, Path("/nonexistent")).error == "Invalid slot ID"


def test_a_save_of_a_busy_lane_waits_until_its_request_is_done(tiny_qwen3_dir: Path,
                                                               tmp_path: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    core.handle(p.Generate("r", prompt(1), greedy(6), 1))
    core.step()
    core.handle(p.SlotCommand("s", "save", 1, str(tmp_path / "a.bin")))
    core.handle(p.SlotCommand("e", "erase", 1))
    assert not [e for e in events if isinstance(e, p.SlotReply)]
    assert len(core.slot_actions.deferred) == 2
    while core.has_work:
        core.step()
    core.slot_actions.retry()
    replies = [e for e in events if isinstance(e, p.SlotReply)]
    # In order: the save saw the whole request, the erase came after it.
    assert [r.action_id for r in replies] == ["s", "e"]
    assert replies[0].num_tokens == 50 + 6 and replies[1].num_tokens == 50 + 6
    assert finished(events, "r")


def finished(events: list[p.EngineEvent], request_id: str) -> bool:
    return any(o.request_id == request_id and o.finish_reason for o in step_outputs(events))
