"""Shutdown in the engine (CPU): it acts at once, ends what it still holds
with an "abort" output, and its loop returns (the process then exits 0)."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import protocol as p
from tests.engine import in_process


def test_shutdown_aborts_what_is_left_and_ends_the_loop(tiny_qwen3_dir: Path) -> None:
    core, events = in_process.make_engine(tiny_qwen3_dir, page_size=8, max_batched_tokens=64,
                                          max_concurrency=1, kv_capacity_tokens=512)
    params = p.SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    commands: queue.Queue[p.RouterCommand] = queue.Queue()
    # One running, one waiting for the only lane.
    commands.put(p.Generate("running", [11, 12, 13], params))
    commands.put(p.Generate("waiting", [14, 15, 16], params))
    loop = threading.Thread(target=core.run, args=(commands,), daemon=True)
    loop.start()
    # Let it produce a few tokens, then stop it mid-generation.
    for _ in range(200):
        if any(o.request_id == "running" and o.token_ids for o in in_process.step_outputs(events)):
            break
        loop.join(0.01)
    commands.put(p.Shutdown())
    loop.join(10)
    assert not loop.is_alive(), "the busy loop ignored Shutdown"
    ends = {o.request_id: o.finish_reason for o in in_process.step_outputs(events)
            if o.finish_reason is not None}
    assert ends == {"running": "abort", "waiting": "abort"}
    assert not core.has_work
    core.scheduler.check_invariants()
