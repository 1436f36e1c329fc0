"""Strict tools under tool_choice auto, served by the real engine with the tiny
random Qwen3, through Chat Completions, Responses and Messages.

The random model never writes `<tool_call>` on its own (tests/engine/
test_strict_tool_grammar.py makes it call, in-process, and checks the call's
arguments), so here what shows the grammar at work is the part of it every
turn meets: the Qwen3 template thinks, and the grammar has the answer open
with `<think>`, which this model, left free, does not write. The engine
compiling the grammar at all is checked too: a tag it refused would be a 400.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
SAMPLING = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_qwen3_server: Server) -> Server:
    return tiny_qwen3_server  # tests/e2e/conftest.py: one server for the package


def _chat(server: Server, strict: bool) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "get_weather", "strict": strict, "parameters": SCHEMA}}
    response = server.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [tool], "max_tokens": 16, **SAMPLING})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def test_chat_completions(server: Server) -> None:
    assert _chat(server, strict=True).get("reasoning_content")
    assert not _chat(server, strict=False).get("reasoning_content")  # the model left free


def test_responses(server: Server) -> None:
    def kinds(strict: bool) -> list[str]:
        tool = {"type": "function", "name": "get_weather", "strict": strict, "parameters": SCHEMA}
        response = server.post("/v1/responses", json={
            "input": ASK, "tools": [tool], "max_output_tokens": 16, **SAMPLING})
        assert response.status_code == 200, response.text
        return [item["type"] for item in response.json()["output"]]

    assert "reasoning" in kinds(strict=True)
    assert "reasoning" not in kinds(strict=False)


def test_messages(server: Server) -> None:
    def kinds(strict: bool) -> list[str]:
        tool = {"name": "get_weather", "strict": strict, "input_schema": SCHEMA}
        response = server.post("/v1/messages", json={
            "model": "tiny", "messages": ASK, "tools": [tool], "max_tokens": 16, **SAMPLING})
        assert response.status_code == 200, response.text
        return [block["type"] for block in response.json()["content"]]

    assert "thinking" in kinds(strict=True)
    assert "thinking" not in kinds(strict=False)


def test_a_strict_schema_the_grammar_cannot_enforce_is_refused(server: Server) -> None:
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "tags": {"type": "array", "uniqueItems": True}}}
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": schema}}
    response = server.post("/v1/chat/completions", json={"messages": ASK, "tools": [tool], "max_tokens": 4})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools[0].function.parameters.properties.tags.uniqueItems"
