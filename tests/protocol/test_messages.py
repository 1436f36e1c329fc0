from __future__ import annotations

import msgspec
import pytest

import protocol as p


def roundtrip_command(message: p.RouterCommand) -> p.RouterCommand:
    return p.command_decoder().decode(p.encoder().encode(message))


def roundtrip_event(message: p.EngineEvent) -> p.EngineEvent:
    return p.event_decoder().decode(p.encoder().encode(message))


def test_commands_roundtrip_through_the_tagged_union() -> None:
    params = p.SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=42, stop_token_ids=[2])
    for message in [
        p.Generate("r1", [1, 2, 3], params),
        p.Generate("r2", [4], p.SamplingParams(max_tokens=9, reasoning=p.ReasoningBudget(
            budget=5, close_ids=[8], end_ids=[6, 8, 7], after_ids=[3]))),
        p.Abort(["r1", "r2"]),
        p.Shutdown(),
    ]:
        assert roundtrip_command(message) == message


def test_events_roundtrip_through_the_tagged_union() -> None:
    facts = p.ModelFacts("LlamaForCausalLM", 100, 2048, 64, 2, 4, 2, 1000, 4000, "float32", "cpu")
    kv = p.KvFacts(16, 10, 160, 8, 512, 1024)
    for message in [
        p.LoadProgress(0.5, "layer 3"),
        p.Ready(p.PROTOCOL_VERSION, 123, facts, kv, 1.5),
        p.StepOutputs(3, [p.RequestOutput("r1", [5], "stop", 3, 0), p.RequestOutput("r2", [])],
                      p.EngineStats(running=2, kv_pages_total=10)),
        p.RequestError("r1", p.ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long"),
        p.EngineDead("boom", "Traceback..."),
    ]:
        assert roundtrip_event(message) == message


def test_messages_are_arrays_on_the_wire() -> None:
    raw = msgspec.msgpack.decode(p.encoder().encode(p.Abort(["x"])))
    assert raw == ["abort", ["x"]]


def test_a_command_is_not_an_event() -> None:
    with pytest.raises(msgspec.ValidationError):
        p.event_decoder().decode(p.encoder().encode(p.Shutdown()))


def test_sampling_flags() -> None:
    assert p.SamplingParams(max_tokens=1, temperature=0.0).greedy
    assert p.SamplingParams(max_tokens=1, top_k=1).greedy
    assert not p.SamplingParams(max_tokens=1).greedy
    assert p.SamplingParams(max_tokens=1, presence_penalty=0.5).has_penalties


def test_engine_options_travel_as_json_and_are_validated() -> None:
    options = p.EngineOptions(device="cuda:1", max_concurrency=64, max_batched_tokens=2048)
    assert p.EngineOptions.from_json(options.to_json()) == options
    assert options.is_cuda
    with pytest.raises(ValueError, match="power of two"):
        p.EngineOptions(page_size=12)
    with pytest.raises(ValueError, match="every lane"):
        p.EngineOptions(max_concurrency=64, max_batched_tokens=32)
    with pytest.raises(msgspec.ValidationError):
        p.EngineOptions.from_json('{"no_such_option": 1}')
