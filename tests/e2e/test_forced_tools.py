"""Forced tool calls on the real engine with the tiny random Qwen3: the turn
ends when the calls close, and a forced call costs no more tokens than the
same call written freely (its opener is in the prompt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.text.model_text import ModelText
from tests.support.server import Server

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
QUIET = {"chat_template_kwargs": {"enable_thinking": False}, "temperature": 0, "max_tokens": 120}


@pytest.fixture(scope="module")
def server(tiny_qwen3_server: Server) -> Server:
    return tiny_qwen3_server  # tests/e2e/conftest.py: one server for the package


def _free_tokens(text: ModelText, call: dict) -> int:
    """Tokens of the same call written freely, as the template spells it."""
    written = ('<tool_call>\n{"name": "' + call["function"]["name"] + '", "arguments": '
               + call["function"]["arguments"] + "}\n</tool_call>")
    return len(text.tokenizer.encode(written)) + 1  # and the end-of-turn token


def _chat(server: Server, choice: object, parallel: bool) -> dict:
    return server.post("/v1/chat/completions", json={
        "messages": ASK, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel,
        **QUIET}).json()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_ends_the_turn_and_costs_no_more_than_a_free_one(
        server: Server, tiny_qwen3_dir: Path, choice: object) -> None:
    reply = _chat(server, choice, parallel=False)
    result = reply["choices"][0]
    assert result["finish_reason"] == "tool_calls", reply
    assert not result["message"]["content"]
    (call,) = result["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"]
    # The wrapper and the name are in the prompt, so only the arguments and
    # the closing are generated; before, the grammar had the model spell the
    # wrapper too (49 tokens against 30 for this model and prompt).
    free = _free_tokens(ModelText.load(tiny_qwen3_dir), call)
    assert reply["usage"]["completion_tokens"] <= free


def test_required_with_parallel_calls_allows_calls_and_nothing_else(server: Server) -> None:
    reply = _chat(server, "required", parallel=True)
    result = reply["choices"][0]
    # Before, free text followed the first call up to the token limit. Now
    # only more calls or the end of the turn may follow one (this random
    # model keeps calling until the limit, which cuts its last call).
    assert not result["message"]["content"], reply
    calls = result["message"]["tool_calls"]
    finished = calls if result["finish_reason"] == "tool_calls" else calls[:-1]
    assert finished and all(json.loads(c["function"]["arguments"])["city"] for c in finished)


def test_anthropic_any_ends_with_tool_use(server: Server) -> None:
    body = {"model": "tiny", "max_tokens": 120, "temperature": 0, "messages": ASK,
            "thinking": {"type": "disabled"},
            "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]}
    one = server.post("/v1/messages", json={
        **body, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}).json()
    assert one["stop_reason"] == "tool_use", one
    assert [block["type"] for block in one["content"]] == ["tool_use"]
    many = server.post("/v1/messages", json={**body, "tool_choice": {"type": "any"}}).json()
    assert {block["type"] for block in many["content"]} == {"tool_use"}, many
