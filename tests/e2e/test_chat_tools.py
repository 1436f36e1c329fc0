"""Chat Completions with tools and reasoning, through the openai SDK, against
a real server whose engine answers from a script (known output)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.support.scripted_models import (
    CODER_SCRIPT,
    CODER_TEMPLATE,
    ENGINE_ENV,
    QWEN3_SCRIPT,
    WEATHER_CALL,
    scripted_model,
)
from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    models = tmp_path_factory.mktemp("scripted") / "models"
    models.mkdir()
    scripted_model(models / "qwen3-scripted", tiny_qwen3_dir, QWEN3_SCRIPT)
    scripted_model(models / "coder-scripted", tiny_qwen3_dir, CODER_SCRIPT, CODER_TEMPLATE)
    with running_server(["--models-dir", str(models), "--models-max", "0"],
                        tmp_path_factory.mktemp("scripted-log") / "router.log", env=ENGINE_ENV) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def ask(client: openai.OpenAI, text: str, **kwargs):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(
        model=kwargs.pop("model", "qwen3-scripted"),
        messages=[{"role": "user", "content": text}], **kwargs)


def test_a_tool_call_with_reasoning(client: openai.OpenAI) -> None:
    reply = ask(client, "What's the weather in Paris?", tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    assert message.reasoning_content == "The user asks about the weather, so I call the tool."
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WEATHER_CALL
    details = reply.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < reply.usage.completion_tokens
    timings = reply.model_extra["timings"]
    assert timings["predicted_n"] == reply.usage.completion_tokens
    assert {"cache_n", "prompt_n", "prompt_ms", "prompt_per_second", "predicted_ms",
            "predicted_per_token_ms", "predicted_per_second"} <= set(timings)


def test_a_streamed_tool_call(client: openai.OpenAI) -> None:
    chunks = list(ask(client, "What's the weather in Paris?", tools=[WEATHER_TOOL], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "The user asks about the weather, so I call the tool."
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    first, rest = calls[0], calls[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert all(tc.id is None and tc.index == 0 for tc in rest)
    arguments = (first.function.arguments or "") + "".join(tc.function.arguments for tc in rest)
    assert json.loads(arguments) == WEATHER_CALL
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "timings" in chunks[-1].model_extra


def test_the_tool_result_round_trip(client: openai.OpenAI) -> None:
    first = ask(client, "What's the weather in Paris?", tools=[WEATHER_TOOL])
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 24}'},
    ]
    reply = client.chat.completions.create(model="qwen3-scripted", messages=history, tools=[WEATHER_TOOL])
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert message.content == "It is sunny and 24°C in Paris."
    assert message.reasoning_content == "The tool says it is sunny."
    assert not message.tool_calls


def test_parallel_tool_calls(client: openai.OpenAI) -> None:
    reply = ask(client, "Compare Paris and Rome", tools=[WEATHER_TOOL])
    calls = reply.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.id for c in calls}) == 2
    streamed = list(ask(client, "Compare Paris and Rome", tools=[WEATHER_TOOL], stream=True))
    starts = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or []) if tc.id]
    assert [tc.index for tc in starts] == [0, 1]


def test_quoted_markup_stays_text(client: openai.OpenAI) -> None:
    reply = ask(client, "How do tools work?", tools=[WEATHER_TOOL])
    message = reply.choices[0].message
    assert not message.tool_calls and reply.choices[0].finish_reason == "stop"
    assert "`<tool_call>`" in message.content and "```\n<tool_call>" in message.content


def test_a_malformed_call_comes_back_as_content(client: openai.OpenAI) -> None:
    reply = ask(client, "Break the call", tools=[WEATHER_TOOL])
    message = reply.choices[0].message
    assert not message.tool_calls and reply.choices[0].finish_reason == "stop"
    assert message.content == "<tool_call>\n{\"name\": \n</tool_call> sorry"


def test_without_tools_the_markup_is_plain_text(client: openai.OpenAI) -> None:
    reply = ask(client, "What's the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="none")
    message = reply.choices[0].message
    assert not message.tool_calls and "<tool_call>" in message.content


def test_reasoning_split_when_streamed(client: openai.OpenAI) -> None:
    chunks = list(ask(client, "Say hello", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
        "A greeting deserves a greeting."
    assert "".join(d.content or "" for d in deltas) == "Hello! How can I help you today?"
    whole = ask(client, "Say hello")
    assert whole.choices[0].message.content == "Hello! How can I help you today?"


def test_qwen3_coder_xml_calls(client: openai.OpenAI) -> None:
    reply = ask(client, "What's the weather in Paris?", tools=[WEATHER_TOOL], model="coder-scripted")
    message = reply.choices[0].message
    assert message.content == "Let me check."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    # Typed by the tool's schema: days is an integer.
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_prompt_progress_before_the_answer(server: Server) -> None:
    import requests

    body = {"model": "qwen3-scripted", "messages": [{"role": "user", "content": "Say hello"}],
            "stream": True, "return_progress": True}
    lines = [line for line in requests.post(server.url + "/v1/chat/completions", json=body,
                                            timeout=60).iter_lines() if line.startswith(b"data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress and progress[-1]["processed"] == progress[-1]["total"]
    first_content = next(i for i, c in enumerate(chunks) if c["choices"] and
                         c["choices"][0]["delta"].get("reasoning_content"))
    assert max(i for i, c in enumerate(chunks) if "prompt_progress" in c) < first_content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 17}, "n"),
        ({"logit_bias": {"999999999": 5}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
    ],
)
def test_what_we_cannot_do_is_a_400_naming_the_field(server: Server, extra: dict, param: str) -> None:
    body = {"model": "qwen3-scripted", "messages": [{"role": "user", "content": "hi"}], **extra}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_neutral_values_and_unknown_fields_are_accepted(server: Server) -> None:
    body = {"model": "qwen3-scripted", "messages": [{"role": "user", "content": "Say hello"}],
            "n": 1, "logit_bias": {"42": 0}, "logprobs": False, "modalities": ["text"],
            "something_new": {"a": 1}, "reasoning_effort": "high"}
    assert server.post("/v1/chat/completions", json=body).status_code == 200


def test_the_v1_v1_path_answers_too(server: Server) -> None:
    body = {"model": "qwen3-scripted", "messages": [{"role": "user", "content": "Say hello"}]}
    response = server.post("/v1/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello! How can I help you today?"
