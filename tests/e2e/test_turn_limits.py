"""What clients meet at a turn's edges, against a scripted engine: context
checks at admission, output limits, tool calls cut by the limit, keep-alives
on quiet streams, and llama.cpp's chunk shapes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from router.build_info import build_fingerprint
from router.text.model_text import ModelText
from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow

MODEL = "one-lane"
LONG = [{"role": "user", "content": "Tell me a long story"}]
SLOW = [{"role": "user", "content": "Think slowly"}]
WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]
# The scripted engine's context is the tiny model's 2,048 tokens.
HUGE = [{"role": "user", "content": "hello " * 2100}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
# Keep-alives every 0.2 s: a first token held back 1 s is preceded by four.
KEEPALIVE = 0.2
SCRIPT = {**QWEN3_SCRIPT, "rules": [
    *QWEN3_SCRIPT["rules"],
    {"when": "Think slowly", "reply": "Done.", "first_token_after": 1.0},
]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("limits") / "models"
    models.mkdir()
    scripted_model(models / MODEL, tiny_qwen3_dir, SCRIPT)
    args = ["--models-dir", str(models), "--max-concurrency", "1", "--pending-timeout-ms", "1500"]
    env = {**ENGINE_ENV, "ROUNDHOUSE_SSE_KEEPALIVE": str(KEEPALIVE)}
    with running_server(args, tmp_path_factory.mktemp("limits-log") / "router.log", env=env) as running:
        yield running


@pytest.fixture(scope="module")
def unpaced(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Iterator[Server]:
    """The same model unpaced, for an answer run to the end of its 1,000-odd
    tokens: paced, as on the module's server, that takes over 10 s."""
    models = tmp_path_factory.mktemp("limits-unpaced") / "models"
    models.mkdir()
    scripted_model(models / MODEL, tiny_qwen3_dir, {**SCRIPT, "step_seconds": 0})
    args = ["--models-dir", str(models), "--max-concurrency", "1"]
    with running_server(args, tmp_path_factory.mktemp("limits-unpaced-log") / "router.log",
                        env=ENGINE_ENV) as running:
        yield running


class LaneHolder:
    """A streamed long story read on a thread: it holds the only lane."""

    def __init__(self, server: Server):
        body = {"model": MODEL, "messages": LONG, "stream": True, "max_tokens": -1}
        self.response = requests.post(server.url + "/v1/chat/completions", json=body, stream=True,
                                      timeout=60)
        self.lines = self.response.iter_lines()
        next(line for line in self.lines if line.startswith(b"data: "))

    def close(self) -> None:
        self.response.close()


def sse_lines(response: requests.Response) -> list[str]:
    return [line.decode() for line in response.iter_lines() if line]


def data_events(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


# ---- 3. the context check at admission ---------------------------------------------------


def test_an_over_long_prompt_is_refused_at_once_while_the_lane_is_busy(server: Server) -> None:
    holder = LaneHolder(server)
    try:
        cases = [
            ("/v1/chat/completions", {"messages": HUGE}, "messages"),
            ("/v1/chat/completions", {"messages": HUGE, "stream": True}, "messages"),
            ("/v1/completions", {"prompt": "hello " * 2100}, "prompt"),
            ("/v1/responses", {"input": "hello " * 2100}, "input"),
        ]
        for path, extra, param in cases:
            started = time.monotonic()
            reply = server.post(path, json={"model": MODEL, **extra})
            assert time.monotonic() - started < 1, path
            assert reply.status_code == 400, (path, reply.text)
            error = reply.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == param, path
        started = time.monotonic()
        claude = server.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": HUGE})
        assert time.monotonic() - started < 1
        assert claude.status_code == 400 and claude.json()["error"]["type"] == "invalid_request_error"
        native = server.post("/completion", json={"prompt": "hello " * 2100})
        assert native.status_code == 400
        error = native.json()["error"]
        assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 2048
        assert error["n_prompt_tokens"] > 2048
    finally:
        holder.close()


# ---- 4. output limits ----------------------------------------------------------------------


def test_a_limit_beyond_the_context_is_a_400_on_openai_routes(server: Server, unpaced: Server) -> None:
    chat = server.post("/v1/chat/completions", json={"model": MODEL, "messages": LONG,
                                                     "max_tokens": 5000})
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    assert chat.json()["error"]["param"] == "messages"
    # Anthropic's API lets max_tokens pass the context and says where it stopped;
    # llama.cpp's own route clamps, as llama.cpp does. Both are accepted: their
    # streams open (and are closed here, which aborts them: their ends are not
    # the point).
    for path, body in (("/v1/messages", {"model": MODEL, "max_tokens": 5000, "messages": LONG}),
                       ("/completion", {"prompt": "Tell me a long story", "n_predict": 5000})):
        with requests.post(server.url + path, json={**body, "stream": True}, stream=True,
                           timeout=60) as accepted:
            assert accepted.status_code == 200, (path, accepted.text)
    responses = server.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                                   "max_output_tokens": 5000})
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "input"
    # -1 is "until the context is full".
    completions = unpaced.post("/v1/completions", json={"model": MODEL, "prompt": "Tell me a long story",
                                                        "max_tokens": -1})
    assert completions.status_code == 200
    assert completions.json()["usage"]["completion_tokens"] > 1000


# ---- 5. tool calls cut by the limit --------------------------------------------------------


def _tokens_to(text: ModelText, reply: str, marker: str) -> int:
    """How many of the reply's tokens end just after `marker`."""
    ids = text.tokenizer.encode(reply)
    for count in range(1, len(ids) + 1):
        if marker in text.tokenizer.decode(ids[:count], skip_special_tokens=False):
            return count
    raise AssertionError(marker)


def test_a_call_cut_by_the_limit_is_reported_as_cut(server: Server, tiny_qwen3_dir: Path) -> None:
    text = ModelText.load(tiny_qwen3_dir)
    reply = QWEN3_SCRIPT["rules"][0]["reply"]
    in_arguments = _tokens_to(text, reply, '"city": "Pa')
    body = {"model": MODEL, "messages": WEATHER, "tools": [TOOL], "max_tokens": in_arguments}
    whole = server.post("/v1/chat/completions", json=body).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length"
    (call,) = choice["message"]["tool_calls"]
    # What was generated, never an invented "{}".
    assert call["function"]["arguments"].startswith('{"city": "Pa')
    assert not call["function"]["arguments"].endswith("}")
    assert not choice["message"]["content"]
    # Cut inside the wrapper: no call, and no markup leaking as text.
    in_wrapper = _tokens_to(text, reply, '{"name": "get_')
    wrapper = server.post("/v1/chat/completions", json={**body, "max_tokens": in_wrapper}).json()
    message = wrapper["choices"][0]["message"]
    assert wrapper["choices"][0]["finish_reason"] == "length"
    assert not message.get("tool_calls") and "<tool_call>" not in (message["content"] or "")
    # Responses: the cut call is an incomplete item of an incomplete response.
    response = server.post("/v1/responses", json={
        "model": MODEL, "input": "What's the weather in Paris?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}],
        "max_output_tokens": in_arguments}).json()
    assert response["status"] == "incomplete"
    (item,) = [i for i in response["output"] if i["type"] == "function_call"]
    assert item["status"] == "incomplete" and item["arguments"].startswith('{"city": "Pa')


# ---- 6. keep-alives ------------------------------------------------------------------------


def test_a_slow_first_token_gets_keepalives(server: Server) -> None:
    body = {"model": MODEL, "messages": SLOW, "stream": True}
    lines = sse_lines(requests.post(server.url + "/v1/chat/completions", json=body, stream=True,
                                    timeout=30))
    first_content = next(i for i, line in enumerate(lines) if '"content":"Done' in line)
    assert lines[:first_content].count(": keep-alive") >= 2
    claude = requests.post(server.url + "/v1/messages", stream=True, timeout=30, json={
        "model": MODEL, "max_tokens": 50, "stream": True, "messages": SLOW})
    assert claude.status_code == 200
    lines = sse_lines(claude)
    start = lines.index("event: message_start")
    # Pinged before message_start (which waits for the first token) ...
    assert lines[:start].count("event: ping") >= 2
    assert 'data: {"type": "ping"}' in lines[:start]
    assert lines[-2:] == ["event: message_stop", 'data: {"type":"message_stop"}']
    native = sse_lines(requests.post(server.url + "/completion", stream=True, timeout=30, json={
        "prompt": "Think slowly", "stream": True}))
    assert native.count(": keep-alive") >= 2


def test_a_long_wait_in_the_queue_opens_the_stream_and_keeps_it_alive(server: Server) -> None:
    holder = LaneHolder(server)
    try:
        started = time.monotonic()
        waiting = requests.post(server.url + "/v1/chat/completions", stream=True, timeout=30, json={
            "model": MODEL, "messages": SLOW, "stream": True})
        # Headers long before the 1.5 s queue timeout ...
        assert waiting.status_code == 200 and time.monotonic() - started < 1.2
        lines = sse_lines(waiting)
        assert lines.count(": keep-alive") >= 1
        # ... and the timeout, when it comes, is an error chunk.
        (error,) = [e for e in data_events(lines) if "error" in e]
        assert error["error"]["code"] == "request_queue_timeout"
        assert lines[-1] == "data: [DONE]"
        claude = requests.post(server.url + "/v1/messages", stream=True, timeout=30, json={
            "model": MODEL, "max_tokens": 5, "stream": True, "messages": SLOW})
        lines = sse_lines(claude)
        assert claude.status_code == 200 and "event: ping" in lines and "event: error" in lines
    finally:
        holder.close()


# ---- 7. llama.cpp's chunk shapes -----------------------------------------------------------


def test_llamacpp_shapes_in_chat_and_text_completions(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}]}
    whole = server.post("/v1/chat/completions", json=body).json()
    assert whole["system_fingerprint"] == build_fingerprint()
    chunks = data_events(sse_lines(requests.post(
        server.url + "/v1/chat/completions", json={**body, "stream": True, "timings_per_token": True},
        stream=True, timeout=30)))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(c["system_fingerprint"] == build_fingerprint() for c in chunks)
    content = [c for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]][1:]
    assert content and all(c["choices"][0]["delta"]["content"] for c in content)
    assert all("timings" in c for c in content)
    text = server.post("/v1/completions", json={"model": MODEL, "prompt": "Say hello",
                                                "max_tokens": 3}).json()
    assert text["system_fingerprint"] == build_fingerprint()
    # The OpenAI SDK reads the opening chunk's null content.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, stream=True, messages=body["messages"])
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content is None
    assert first.system_fingerprint == build_fingerprint()
    stream.close()
