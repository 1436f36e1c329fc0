"""The engine tests' harness: an EngineCore built and driven in-process, step
by step, its events collected in a list instead of sent over a socket."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch

import protocol as p
from engine.loader import LoadedModel, load_model
from engine.process.bootstrap import assemble_engine, build_engine, resolve_dtype
from engine.scheduling.core import EngineCore
from tests.engine.fixed_costs import FixedCosts

# Small steps and pages: prompts span several prefill chunks and KV pages.
SMALL_STEPS: dict[str, object] = {"max_batched_tokens": 24, "page_size": 8, "max_concurrency": 4,
                                  "kv_capacity_tokens": 4096}


def make_engine(model: Path, **options: object) -> tuple[EngineCore, list[p.EngineEvent]]:
    events: list[p.EngineEvent] = []
    launch = p.EngineOptions(**options)  # type: ignore[arg-type]
    core, _ = build_engine(model, launch, lambda fraction, message: None, events.append)
    core.scheduler.draft_costs = FixedCosts()  # tests/engine/fixed_costs.py says why
    return core, events


# CPU weights read once per test session, by (checkpoint, dtype, host expert layers).
_SHARED_WEIGHTS: dict[tuple[Path, torch.dtype, int], LoadedModel] = {}


def shared_weights(model: Path, dtype: torch.dtype = torch.float32,
                   host_expert_layers: int = 0) -> LoadedModel:
    """The checkpoint's CPU weights, read on the first call of the session.
    Only for reading: an engine gets a model object of its own
    (make_engine_sharing_weights), and a test that runs the model itself
    must not change it."""
    key = (model.resolve(), dtype, host_expert_layers)
    if key not in _SHARED_WEIGHTS:
        _SHARED_WEIGHTS[key] = load_model(model, torch.device("cpu"), dtype,
                                          host_expert_layers=host_expert_layers)
    return _SHARED_WEIGHTS[key]


def make_engine_sharing_weights(model: Path, **options: object
                                ) -> tuple[EngineCore, list[p.EngineEvent]]:
    """make_engine on CPU with the checkpoint read only once per session:
    SmolLM2's GGUF takes 5-10 s to read and dequantize on the CI machine,
    and the speculation tests build a dozen engines on it. Engines only read
    their weights on CPU (the reference ops; no sleep here), so any number of
    them may share the weights; the loader has its own tests."""
    launch = p.EngineOptions(**options)  # type: ignore[arg-type]
    assert launch.device == "cpu" and not launch.draft_model and not launch.threads, (
        "CPU engines without a draft model or a thread count only")
    shared = shared_weights(model, resolve_dtype(launch), launch.host_expert_layer_count)
    # A model object of its own (sharing the weight tensors and layers): the
    # engine sets its ops on it, and a test may patch one engine's model.
    loaded = dataclasses.replace(shared, model=copy.copy(shared.model))
    events: list[p.EngineEvent] = []
    core, _ = assemble_engine(loaded, model, launch, lambda fraction, message: None, events.append)
    core.scheduler.draft_costs = FixedCosts()  # tests/engine/fixed_costs.py says why
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
