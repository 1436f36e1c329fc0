"""Thinking budgets through a real server and the real openai and anthropic
SDKs, with the tiny random Qwen3 on the real engine.

The random model never closes a reasoning block by itself: without a budget
a thinking turn would reason until max_tokens and leave the answer empty.
With one, the engine ends the block (Qwen3's "\\n</think>\\n\\n") and the
model answers. The server is started with --reasoning-budget 12, the
default for requests that name none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from router.text.model_text import ModelText
from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"temperature": 0}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
SERVER_BUDGET = 12


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("thinking-budget") / "router.log"
    args = [str(tiny_qwen3_dir), "--threads", "1", "--reasoning-budget", str(SERVER_BUDGET)]
    with running_server(args, log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def text(tiny_qwen3_dir: Path) -> ModelText:
    return ModelText.load(tiny_qwen3_dir)


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    extra = fields.pop("extra_body", {})
    return client.chat.completions.create(model="tiny", messages=ASK, extra_body=extra,
                                          **{**GREEDY, **fields})


def reasoning_of(message: Any) -> str:
    return (message.model_extra or {}).get("reasoning_content") or ""


def tokens(text: ModelText, reasoning: str) -> int:
    return len(text.tokenizer.encode(reasoning))


def test_a_budget_ends_the_reasoning_and_the_model_answers(client: openai.OpenAI, text: ModelText) -> None:
    reply = chat(client, max_tokens=40, extra_body={"thinking_budget": 8})
    choice = reply.choices[0]
    reasoning = reasoning_of(choice.message)
    assert reasoning and choice.message.content, reply
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 40
    # Eight tokens of the model's own, give or take how its text re-tokenizes.
    assert 4 <= tokens(text, reasoning) <= 10, reasoning
    assert reply.usage.completion_tokens_details.reasoning_tokens <= 8 + 3


def test_the_same_in_a_stream(client: openai.OpenAI) -> None:
    stream = chat(client, max_tokens=30, stream=True,
                  extra_body={"chat_template_kwargs": {"thinking_budget": 6}})
    reasoning, content = [], []
    for chunk in stream:
        for choice in chunk.choices:
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) and "".join(content)
    assert "</think>" not in "".join(content)


def test_an_effort_level_leaves_the_answer_room(client: openai.OpenAI, text: ModelText) -> None:
    # "low" is 1024 tokens, capped at three quarters of max_tokens.
    reply = chat(client, max_tokens=40, reasoning_effort="low")
    message = reply.choices[0].message
    assert message.content and 20 <= tokens(text, reasoning_of(message)) <= 32
    off = chat(client, max_tokens=20, reasoning_effort="none").choices[0].message
    assert not reasoning_of(off) and off.content


def test_the_servers_budget_for_requests_that_name_none(client: openai.OpenAI, text: ModelText) -> None:
    message = chat(client, max_tokens=40).choices[0].message
    assert message.content and tokens(text, reasoning_of(message)) <= SERVER_BUDGET + 2


def test_a_json_answer_defaults_to_thinking_off(client: openai.OpenAI) -> None:
    message = chat(client, max_tokens=60, response_format=JSON_FORMAT).choices[0].message
    assert not reasoning_of(message)
    assert json.loads(message.content) in ({"ok": True}, {"ok": False})


def test_a_json_answer_after_a_budget(client: openai.OpenAI) -> None:
    reply = chat(client, max_tokens=80, response_format=JSON_FORMAT, extra_body={"thinking_budget": 10})
    message = reply.choices[0].message
    assert reasoning_of(message) and reply.choices[0].finish_reason == "stop"
    assert json.loads(message.content) in ({"ok": True}, {"ok": False})


def test_a_forced_call_after_a_budget(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}}
    reply = chat(client, max_tokens=100, tools=[tool], tool_choice="required",
                 parallel_tool_calls=False, extra_body={"thinking_budget": 10})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and reasoning_of(choice.message)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


def test_anthropic_budget_tokens_are_enforced(server: Server, text: ModelText) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)
    reply = client.messages.create(model="tiny", max_tokens=1100, messages=ASK,
                                   thinking={"type": "enabled", "budget_tokens": 1024},
                                   extra_body=GREEDY)
    thinking, answer = reply.content
    assert thinking.type == "thinking" and answer.type == "text" and answer.text
    assert 900 <= tokens(text, thinking.thinking) <= 1100
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 1100
