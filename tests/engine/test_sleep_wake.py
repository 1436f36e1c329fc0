"""Sleep and wake in the engine (CPU): the device state goes and comes back,
the prefix cache survives, and the commands answer as the router expects.

The engine runs in-process (EngineCore driven with handle() and step()), as in
test_engine_exactness.py; tests/engine/test_sleep_wake_gpu.py does the same on
CUDA and checks that the device memory really goes back.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution.device_state import WeightStash, model_tensors
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs

PAGE = 8


def make_engine(model: Path) -> tuple[EngineCore, list[p.EngineEvent]]:
    return in_process.make_engine(model, page_size=PAGE, max_batched_tokens=64, max_concurrency=4,
                                  kv_capacity_tokens=512)


def prompt(seed: int, length: int = 37) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 150000, (length,), generator=generator).tolist()


def greedy(max_tokens: int = 8) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(core: EngineCore, events: list[p.EngineEvent], request_id: str,
        tokens: list[int]) -> tuple[list[int], int]:
    """(generated tokens, prompt tokens served from the prefix cache)."""
    outputs = step_outputs(run_to_completion(core, events, {request_id: (tokens, greedy())}))
    assert outputs and all(o.request_id == request_id for o in outputs), events
    return [t for o in outputs for t in o.token_ids], outputs[-1].num_cached_tokens


def only(events: list[p.EngineEvent], kind: type) -> object:
    matching = [e for e in events if isinstance(e, kind)]
    assert len(matching) == 1, events
    return matching[0]


@pytest.mark.parametrize("weights", ["host", "disk"])
def test_wake_restores_pages_weights_and_outputs(tiny_qwen3_dir: Path, weights: str) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    runner, pool = core.runner, core.scheduler.kv.pool
    conversation, other = prompt(1), prompt(2, 20)
    run(core, events, "warm", conversation)
    expected, cached_before = run(core, events, "again", conversation)
    run(core, events, "other", other)
    # All but the last prompt token, always computed: 4 full pages and the
    # first 4 tokens of the fifth (reused to the token: engine/kv/partial_pages.py).
    assert cached_before == 36
    pages = pool.cached_pages()
    kv_before = [(k[pages].clone(), v[pages].clone()) for k, v in runner.kv_caches]
    weights_before = {name: t.clone() for name, t in model_tensors(runner.model).items()}
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)

    events.clear()
    core.handle(p.Sleep(weights=weights))  # type: ignore[arg-type]
    slept = only(events, p.Slept)
    assert isinstance(slept, p.Slept)
    assert slept.kept_pages == len(pages) >= 6
    assert slept.device_bytes == 0 and slept.seconds >= 0
    assert core.asleep and runner.asleep
    assert runner.kv_caches == []
    kept = runner._sleeping.kv  # type: ignore[union-attr]
    assert kept.pages == pages and kept.nbytes < kv_bytes / 4  # free pages were not copied
    emptied = {name for name, t in model_tensors(runner.model).items() if t.numel() == 0}
    # On the CPU the weights are already in host memory: "host" keeps them where they are.
    assert emptied == (set(weights_before) if weights == "disk" else set())
    assert pool.cached_pages() == pages  # the bookkeeping does not notice the sleep

    events.clear()
    core.handle(p.Wake())
    awake = only(events, p.Awake)
    assert isinstance(awake, p.Awake) and awake.seconds > 0
    assert not core.asleep and not runner.asleep
    for (k, v), (k_before, v_before) in zip(runner.kv_caches, kv_before, strict=True):
        assert torch.equal(k[pages], k_before) and torch.equal(v[pages], v_before)
    restored = model_tensors(runner.model)
    for name, tensor in weights_before.items():
        assert torch.equal(restored[name], tensor), name
    # A tied lm_head is the same parameter as the embedding, before and after.
    assert runner.model.lm_head is runner.model.embed_tokens

    tokens, cached_after = run(core, events, "after", conversation)
    assert (tokens, cached_after) == (expected, cached_before)
    assert run(core, events, "fresh", prompt(3))[0]


def test_asleep_engine_refuses_requests_and_answers_repeats(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    conversation = prompt(4)
    expected = run(core, events, "a", conversation)
    core.handle(p.Sleep(weights="host"))
    first = only(events, p.Slept)

    events.clear()
    core.handle(p.Generate("b", conversation, greedy()))
    error = only(events, p.RequestError)
    assert isinstance(error, p.RequestError)
    assert error.request_id == "b" and error.code == p.ErrorCode.INVALID_REQUEST
    assert "asleep" in error.message and "woken" in error.message
    assert not core.has_work
    core.handle(p.Abort(["b", "unknown"]))
    assert len(events) == 1  # nothing to abort, nothing said
    core.handle(p.Sleep(weights="disk"))  # already asleep: the same answer again
    again = events[-1]
    assert isinstance(first, p.Slept) and isinstance(again, p.Slept)
    assert (again.kept_pages, again.device_bytes) == (first.kept_pages, 0)
    # ...and changed nothing: host mode on the CPU kept the weights in place.
    assert model_tensors(core.runner.model)["norm_weight"].numel() > 0

    events.clear()
    core.handle(p.Wake())
    core.handle(p.Wake())  # already awake
    assert [type(e) for e in events] == [p.Awake, p.Awake]
    assert events[1] == p.Awake(0.0)
    assert run(core, events, "c", conversation) == (expected[0], 36)


def test_sleep_while_requests_run_is_refused_loudly(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    core.handle(p.Generate("busy", prompt(5), greedy()))
    core.step()
    # The router only sends Sleep to an idle engine; anything else is its bug,
    # and the engine reports it (EngineDead) rather than drop the request.
    with pytest.raises(RuntimeError, match="only to an engine with no requests"):
        core.handle(p.Sleep(weights="host"))
    assert not core.asleep and "busy" in core.scheduler
    while core.has_work:
        core.step()
    finished = [o for e in events if isinstance(e, p.StepOutputs) for o in e.outputs
                if o.finish_reason]
    assert [(o.request_id, o.finish_reason) for o in finished] == [("busy", "length")]


def test_outputs_of_an_abort_are_published_before_slept(tiny_qwen3_dir: Path) -> None:
    core, events = make_engine(tiny_qwen3_dir)
    core.handle(p.Generate("left", prompt(6), greedy(100)))
    core.step()
    events.clear()
    core.handle(p.Abort(["left"]))
    core.handle(p.Sleep(weights="host"))
    assert [type(e) for e in events] == [p.StepOutputs, p.Slept]
    step = events[0]
    assert isinstance(step, p.StepOutputs)
    assert [(o.request_id, o.finish_reason) for o in step.outputs] == [("left", "abort")]


def test_disk_wake_refuses_a_model_file_changed_meanwhile(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    # A directory of links to the shared tiny model, whose time we may change.
    model = tmp_path / "model"
    model.mkdir()
    for source in tiny_qwen3_dir.iterdir():
        (model / source.name).symlink_to(source)
    core, events = make_engine(model)
    run(core, events, "a", prompt(7))
    core.handle(p.Sleep(weights="disk"))
    stat = model.stat()
    os.utime(model, (stat.st_atime, stat.st_mtime + 60))
    # The kept pages were computed with the old weights: the engine must end
    # (the router then loads the model afresh) rather than mix the two.
    with pytest.raises(RuntimeError, match="changed while the engine slept"):
        core.handle(p.Wake())


def test_weight_stash_round_trip(tiny_qwen3_dir: Path) -> None:
    # The CPU device keeps its weights in place on Sleep(weights="host"); the
    # stash that CUDA uses is checked here on the CPU, unpinned.
    core, _ = make_engine(tiny_qwen3_dir)
    model = core.runner.model
    before = {name: t.clone() for name, t in model_tensors(model).items()}
    stash = WeightStash(model, pin=False)
    assert all(t.numel() == 0 for t in model_tensors(model).values())
    assert stash.nbytes >= sum(t.nbytes for t in before.values())
    stash.put_back(model, torch.device("cpu"))
    after = model_tensors(model)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert model.lm_head is model.embed_tokens


def test_disk_wake_refuses_a_same_size_rewrite_with_its_times_put_back(
        tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    # A real copy of the weights (the test rewrites them), the rest linked.
    model = tmp_path / "model"
    model.mkdir()
    for source in tiny_qwen3_dir.iterdir():
        if source.suffix == ".safetensors":
            (model / source.name).write_bytes(source.read_bytes())
        else:
            (model / source.name).symlink_to(source)
    (weights,) = model.glob("*.safetensors")
    core, events = make_engine(model)
    run(core, events, "a", prompt(7))
    core.handle(p.Sleep(weights="disk"))
    before = weights.stat()
    # Other bytes of the same length at the end of the tensor data (still a
    # valid file), then the old times put back: size and mtime say "same".
    with open(weights, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        tail = f.read(64)
        f.seek(-64, os.SEEK_END)
        f.write(bytes(b ^ 0x5A for b in tail))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(RuntimeError, match="changed while the engine slept"):
        core.handle(p.Wake())
