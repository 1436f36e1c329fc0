"""Anthropic's Messages API through the anthropic SDK and raw SSE, against a
real server whose engine answers from a script (known output), plus one plain
request to the real engine."""

from __future__ import annotations

import base64
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
import requests

from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, WEATHER_CALL, scripted_model
from tests.support.server import Server, running_server, wait_until

pytestmark = pytest.mark.slow

SUNNY = "It is sunny and 24°C in Paris."
LONG_STORY = "Once upon a time " + "there was a roundhouse full of engines, " * 200 + "the end."

SCRIPT = {
    # The shared rules (tool calls, a tool result, a greeting) plus this
    # module's own; an own rule comes first so it wins a tie.
    "rules": [
        # A failed tool call reaches the model as "Error: ..." in the tool's text.
        {"when": "Error: no such city",
         "reply": "<think>\nThe tool failed.\n</think>\n\nSorry, I could not find that city."},
        {"when": "Count to five",
         "reply": "<think>\nCounting.\n</think>\n\nOne, two, three, four, five."},
        {"when": "Answer plainly", "reply": "Plain answer."},
        {"when": "Tell me a long story", "reply": LONG_STORY},
        {"when": "The best answer is (", "reply": "B) Helios"},
        *QWEN3_SCRIPT["rules"],
    ],
    "default": QWEN3_SCRIPT["default"],
}
assert any(rule["reply"].endswith(SUNNY) for rule in QWEN3_SCRIPT["rules"])

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                     "required": ["city"]},
}
MODEL = "claude-scripted"
WEATHER_Q = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    models = tmp_path_factory.mktemp("anthropic") / "models"
    models.mkdir()
    scripted_model(models / MODEL, tiny_qwen3_dir, SCRIPT)
    # Never asked for with autoload on: stays unloaded for the 529 test.
    scripted_model(models / "never-loaded", tiny_qwen3_dir, SCRIPT)
    # Its engine gets killed mid-stream.
    scripted_model(models / "doomed", tiny_qwen3_dir, SCRIPT)
    with running_server(["--models-dir", str(models), "--models-max", "0"],
                        tmp_path_factory.mktemp("anthropic-log") / "router.log", env=ENGINE_ENV) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


def ask(client: anthropic.Anthropic, messages: list[dict] | str, **kwargs: Any) -> anthropic.types.Message:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return client.messages.create(model=kwargs.pop("model", MODEL), max_tokens=kwargs.pop("max_tokens", 2048),
                                  messages=messages, **kwargs)


def streamed(client: anthropic.Anthropic, messages: list[dict] | str, **kwargs: Any) -> anthropic.types.Message:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    with client.messages.stream(model=MODEL, max_tokens=kwargs.pop("max_tokens", 2048),
                                messages=messages, **kwargs) as stream:
        return stream.get_final_message()


def raw_events(server: Server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed reply, read with requests."""
    response = requests.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 2048,
                                                                "stream": True, **body}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.headers["request-id"].startswith("req-")
    events = []
    for chunk in response.text.split("\n\n"):
        if not chunk.strip():
            continue
        name_line, data_line = chunk.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), chunk
        name, data = name_line[len("event: "):], json.loads(data_line[len("data: "):])
        assert data["type"] == name
        events.append((name, data))
    return events


def shape(events: list[tuple[str, dict]]) -> list[str]:
    """Event names with their delta types, runs of the same folded into one."""
    out: list[str] = []
    for name, data in events:
        label = f"{name}:{data['delta']['type']}" if name == "content_block_delta" else name
        if name == "content_block_start":
            label += f":{data['content_block']['type']}"
        if not out or out[-1] != label or name != "content_block_delta":
            out.append(label)
    return out


def comparable(message: anthropic.types.Message) -> list[dict]:
    """Content without the (random) tool_use ids."""
    return [{k: v for k, v in block.model_dump(exclude_none=True).items() if k != "id"}
            for block in message.content]


# ---- replies ------------------------------------------------------------------------


def test_a_reply_with_thinking(client: anthropic.Anthropic) -> None:
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=2048,
                                                   messages=[{"role": "user", "content": "Say hello"}])
    assert raw.headers["request-id"].startswith("req-")
    reply = raw.parse()
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == MODEL
    thinking, text = reply.content
    assert thinking.type == "thinking" and thinking.thinking == "A greeting deserves a greeting."
    assert len(base64.b64decode(thinking.signature)) == 32
    assert text.type == "text" and text.text == "Hello! How can I help you today?"
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    usage = reply.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 10
    assert usage.cache_read_input_tokens == 0 and usage.cache_creation_input_tokens == 0


def test_thinking_disabled_gives_no_thinking_block(client: anthropic.Anthropic) -> None:
    reply = ask(client, "Answer plainly", thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in reply.content] == [("text", "Plain answer.")]


def test_a_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    first = ask(client, WEATHER_Q, tools=[WEATHER_TOOL])
    assert first.stop_reason == "tool_use"
    thinking, call = first.content
    assert thinking.type == "thinking" and thinking.thinking.startswith("The user asks")
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == WEATHER_CALL
    history = [*WEATHER_Q, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": '{"sky": "sunny", "celsius": 24}'}]}]
    final = ask(client, history, tools=[WEATHER_TOOL])
    assert final.stop_reason == "end_turn"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The tool says it is sunny." and final.content[1].text == SUNNY


def test_a_streamed_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    first = streamed(client, WEATHER_Q, tools=[WEATHER_TOOL])
    assert first.stop_reason == "tool_use"
    assert comparable(first) == comparable(ask(client, WEATHER_Q, tools=[WEATHER_TOOL]))
    call = first.content[-1]
    assert call.input == WEATHER_CALL and call.id.startswith("toolu_")
    history = [*WEATHER_Q, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "sunny, 24"}]}]}]
    final = streamed(client, history, tools=[WEATHER_TOOL])
    assert final.stop_reason == "end_turn" and final.content[-1].text == SUNNY
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > first.usage.input_tokens


def test_a_failed_tool_call_reaches_the_model(client: anthropic.Anthropic) -> None:
    history = [*WEATHER_Q, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_x", "name": "get_weather", "input": {"city": "Atlantis"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                      "content": "no such city", "is_error": True}]}]
    reply = ask(client, history, tools=[WEATHER_TOOL])
    assert reply.content[-1].text == "Sorry, I could not find that city."


def test_parallel_tool_use_and_disabling_it(client: anthropic.Anthropic) -> None:
    both = ask(client, "Compare Paris and Rome", tools=[WEATHER_TOOL])
    assert [b.input["city"] for b in both.content if b.type == "tool_use"] == ["Paris", "Rome"]
    one = ask(client, "Compare Paris and Rome", tools=[WEATHER_TOOL],
              tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input["city"] for b in one.content if b.type == "tool_use"] == ["Paris"]
    assert one.stop_reason == "tool_use"
    assert comparable(streamed(client, "Compare Paris and Rome", tools=[WEATHER_TOOL],
                               tool_choice={"type": "auto", "disable_parallel_tool_use": True})) == comparable(one)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client: anthropic.Anthropic, stream: bool) -> None:
    reply = (streamed if stream else ask)(client, "Count to five", stop_sequences=["three", "nine"])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "three"
    assert reply.content[-1].text == "One, two, "


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens(client: anthropic.Anthropic, stream: bool) -> None:
    reply = (streamed if stream else ask)(client, "Tell me a long story", max_tokens=5)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 5
    assert reply.content[0].text.startswith("Once upon")


def test_a_full_context_is_not_max_tokens(client: anthropic.Anthropic) -> None:
    system = "hello " * 1950  # nearly all of the scripted model's 2048-token context
    prompt = client.messages.count_tokens(model=MODEL, system=system,
                                          messages=[{"role": "user", "content": "Tell me a long story"}])
    assert 1900 < prompt.input_tokens < 2000
    reply = ask(client, "Tell me a long story", system=system, max_tokens=4096)
    assert reply.stop_reason == "model_context_window_exceeded"
    assert reply.usage.output_tokens == 2048 - prompt.input_tokens


def test_a_prefill_is_continued(client: anthropic.Anthropic) -> None:
    reply = ask(client, [{"role": "user", "content": "What's the Greek name for Sun? (A) Sol (B) Helios"},
                         {"role": "assistant", "content": "The best answer is ("}])
    assert [(b.type, b.text) for b in reply.content] == [("text", "B) Helios")]
    assert reply.stop_reason == "end_turn"


def test_sampling_fields_are_accepted(client: anthropic.Anthropic) -> None:
    reply = ask(client, "Say hello", metadata={"user_id": "u1"},
                extra_body={"temperature": 0.2, "top_p": 0.9, "top_k": 10})
    assert reply.content[-1].text == "Hello! How can I help you today?"


# ---- the stream's events ------------------------------------------------------------


def test_the_event_sequence_of_thinking_and_text(server: Server, client: anthropic.Anthropic) -> None:
    events = raw_events(server, {"messages": [{"role": "user", "content": "Say hello"}]})
    assert shape(events) == [
        "message_start", "ping",
        "content_block_start:thinking", "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta", "content_block_stop",
        "content_block_start:text", "content_block_delta:text_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] > 0
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0
    indices = [data["index"] for name, data in events if name.startswith("content_block")]
    assert indices == sorted(indices) and set(indices) == {0, 1}
    # The SDK assembles the same message as the non-streamed reply.
    whole = ask(client, "Say hello")
    assert comparable(streamed(client, "Say hello")) == comparable(whole)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta"
                   and d["delta"]["type"] == "text_delta")
    assert text == whole.content[1].text


def test_the_event_sequence_of_thinking_and_tool_use(server: Server) -> None:
    events = raw_events(server, {"messages": WEATHER_Q, "tools": [WEATHER_TOOL]})
    assert shape(events) == [
        "message_start", "ping",
        "content_block_start:thinking", "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta", "content_block_stop",
        "content_block_start:tool_use", "content_block_delta:input_json_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    tool_start = next(d for n, d in events if n == "content_block_start" and d["index"] == 1)
    block = tool_start["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == WEATHER_CALL
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_client_that_disconnects_aborts_its_request(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 4096, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story"}]}
    with requests.post(server.url + "/v1/messages", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines) == b"event: message_start"
        for _ in range(10):
            next(lines)
        assert server.load()[MODEL]["requests"]["running"] == 1
    wait_until(lambda: server.load()[MODEL]["requests"]["running"] == 0, 5,
               "the engine to drop the aborted request", server)


def test_an_engine_that_dies_mid_stream_sends_an_error_event(server: Server,
                                                           client: anthropic.Anthropic) -> None:
    body = {"model": "doomed", "max_tokens": 4096, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story"}]}
    with requests.post(server.url + "/v1/messages", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines) == b"event: message_start"
        os.kill(server.load()["doomed"]["pid"], signal.SIGKILL)
        rest = list(lines)
    assert rest[-3] == b"event: error" and rest[-1] == b""
    error = json.loads(rest[-2][len(b"data: "):])
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert "engine" in error["error"]["message"]
    assert b"event: message_stop" not in rest
    wait_until(lambda: server.load()["doomed"]["state"] == "unloaded", 10, "the failure to be noticed", server)
    # The next request loads the model again; the SDK raises the error event.
    with client.messages.stream(model="doomed", max_tokens=4096,
                                messages=[{"role": "user", "content": "Tell me a long story"}]) as stream:
        events = iter(stream)
        next(events)
        os.kill(server.load()["doomed"]["pid"], signal.SIGKILL)
        with pytest.raises(anthropic.APIStatusError) as caught:
            for _ in events:
                pass
    assert caught.value.body["error"]["type"] == "overloaded_error"


# ---- count_tokens ---------------------------------------------------------------------


def test_count_tokens_matches_the_request(client: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {"messages": WEATHER_Q, "system": "You are terse.", "tools": [WEATHER_TOOL],
                               "thinking": {"type": "enabled", "budget_tokens": 1024}}
    counted = client.messages.count_tokens(model=MODEL, **request)
    reply = ask(client, **request)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert counted.input_tokens == reply.usage.input_tokens  # the scripted engine caches nothing
    fewer = client.messages.count_tokens(model=MODEL, messages=WEATHER_Q)
    assert fewer.input_tokens < counted.input_tokens


def test_count_tokens_loads_nothing(server: Server) -> None:
    response = server.post("/v1/messages/count_tokens",
                           json={"model": "never-loaded", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and response.json()["input_tokens"] > 0
    assert response.headers["request-id"].startswith("req-")
    models = {m["id"]: m["status"]["value"] for m in server.get("/v1/models").json()["data"]}
    assert models["never-loaded"] == "unloaded"


def test_the_v1_v1_path_answers_too(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Say hello"}]}
    response = server.post("/v1/v1/messages", json=body)
    assert response.status_code == 200 and response.json()["content"][-1]["text"].startswith("Hello!")


# ---- errors --------------------------------------------------------------------------

OK = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": MODEL, "messages": OK["messages"]}, "max_tokens"),
        ({**OK, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({**OK, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
         "messages[0].content[0].source"),
        ({**OK, "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 512}},
         "thinking.budget_tokens"),
        ({**OK, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}},
         "thinking.budget_tokens"),
        ({**OK, "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, "web_search"),
        ({**OK, "temperature": 1.5}, "temperature"),
        ({**OK, "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_invalid_requests_are_400s_naming_the_field(server: Server, body: dict, field: str) -> None:
    response = server.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert field in payload["error"]["message"]
    assert payload["request_id"] == response.headers["request-id"] and payload["request_id"].startswith("req-")


def test_the_sdk_sees_a_bad_request(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(client, "hi", max_tokens=1500, thinking={"type": "enabled", "budget_tokens": 1500})
    assert caught.value.status_code == 400 and caught.value.request_id.startswith("req-")
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_404(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        ask(client, "hi", model="claude-nonexistent")
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nonexistent", messages=[{"role": "user", "content": "hi"}])


def test_a_model_that_may_not_load_is_400(client: anthropic.Anthropic) -> None:
    # The client must load it first (POST /models/load), as llama.cpp's router says.
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(client, "hi", model="never-loaded", extra_query={"autoload": "0"})
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "POST /models/load" in caught.value.body["error"]["message"]


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    """One device slot, and little patience for it."""
    models = tmp_path_factory.mktemp("anthropic-busy") / "models"
    models.mkdir()
    scripted_model(models / "a", tiny_qwen3_dir, SCRIPT)
    scripted_model(models / "b", tiny_qwen3_dir, SCRIPT)
    with running_server(["--models-dir", str(models), "--models-max", "1", "--pending-timeout-ms", "300"],
                        tmp_path_factory.mktemp("anthropic-busy-log") / "router.log", env=ENGINE_ENV) as running:
        yield running


def test_no_room_for_a_model_is_529_overloaded(busy_server: Server) -> None:
    client = anthropic.Anthropic(base_url=busy_server.url, api_key="x", max_retries=0)
    body = {"model": "a", "max_tokens": 4096, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story"}]}
    with requests.post(busy_server.url + "/v1/messages", json=body, stream=True, timeout=60) as held:
        # Kept referenced: a dropped line iterator closes the connection (and aborts the request).
        lines = held.iter_lines()
        assert next(lines) == b"event: message_start"
        with pytest.raises(anthropic.OverloadedError) as caught:
            client.messages.create(model="b", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "overloaded_error"
    assert caught.value.request_id.startswith("req-")


# ---- the real engine -------------------------------------------------------------------


def test_the_real_engine_answers(router: Server) -> None:
    """No script: the tiny real model behind the package's router fixture."""
    client = anthropic.Anthropic(base_url=router.url, api_key="x", max_retries=0, timeout=300)
    reply = client.messages.create(model="smollm2", max_tokens=8, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    (block,) = reply.content
    assert block.type == "text" and block.text.strip()
    assert reply.stop_reason in ("end_turn", "max_tokens") and 0 < reply.usage.output_tokens <= 8
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 10
