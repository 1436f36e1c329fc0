"""The engine tests' harness: an EngineCore built and driven in-process, step
by step, its events collected in a list instead of sent over a socket."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import protocol as p
from engine.process.bootstrap import build_engine
from engine.scheduling.core import EngineCore

# Small steps and pages: prompts span several prefill chunks and KV pages.
SMALL_STEPS: dict[str, object] = {"max_batched_tokens": 24, "page_size": 8, "max_concurrency": 4,
                                  "kv_capacity_tokens": 4096}


def make_engine(model: Path, **options: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    events: list[p.EngineEvent] = []
    launch = p.EngineOptions(**options)  # type: ignore[arg-type]
    core, _ = build_engine(model, launch, lambda fraction, message: None, events.append)
    return core, events


def make_engine_and_ready(model: Path, **options: object) -> tuple[p.Ready, EngineCore]:
    """The engine's handshake (what it reports holding) and the engine."""
    launch = p.EngineOptions(**options)  # type: ignore[arg-type]
    core, ready = build_engine(model, launch, lambda fraction, message: None, lambda event: None)
    return ready, core


def run_to_completion(core: EngineCore, events: list[p.EngineEvent],
                      requests: Mapping[str, tuple[list[int], p.SamplingParams]]) -> list[p.EngineEvent]:
    """Submit the requests and step until the scheduler is idle, checking its
    invariants after every step; the events of this run only."""
    events.clear()
    for request_id, (prompt, params) in requests.items():
        core.handle(p.Generate(request_id, prompt, params))
    while core.has_work:
        core.step()
        core.scheduler.check_invariants()
    return events


def step_outputs(events: list[p.EngineEvent]) -> list[p.RequestOutput]:
    return [output for event in events if isinstance(event, p.StepOutputs) for output in event.outputs]
