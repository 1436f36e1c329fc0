"""llama.cpp's native API on a single-model server: /props for its one model,
any model name accepted, and grammar-constrained /completion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.text.model_text import ModelText
from tests.e2e.llamacpp_support import stream_events
from tests.support.server import Server

pytestmark = pytest.mark.slow

CAT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    """SmolLM2 served alone with 4 lanes (tests/e2e/conftest.py)."""
    return smollm2_server


def test_props_of_the_one_model(server: Server, smollm2_gguf: Path) -> None:
    props = server.get("/props").json()
    assert "role" not in props
    assert server.get("/props", params={"model": "anything"}).json() == props
    meta = server.get("/models").json()["data"][0]["meta"]
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == meta["n_ctx"] and settings["is_processing"] is False
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    assert props["total_slots"] == 4
    assert props["model_alias"] == smollm2_gguf.stem and props["model_path"] == str(smollm2_gguf)
    assert props["chat_template"] == ModelText.load(smollm2_gguf).template.source
    assert props["build_info"].endswith("-roundhouse") and props["is_sleeping"] is False
    refused = server.post("/props", json={})
    assert refused.status_code == 501 and refused.json()["error"]["type"] == "not_supported_error"


def test_any_model_name_is_served(server: Server, smollm2_gguf: Path) -> None:
    body = server.post("/completion", json={"model": "gpt-3.5-turbo", "prompt": "Hi", "n_predict": 2,
                                            "temperature": 0}).json()
    assert body["model"] == smollm2_gguf.stem and body["tokens_predicted"] == 2


def test_json_schema_constrains_the_answer(server: Server) -> None:
    body = server.post("/completion", json={"prompt": "A JSON object describing a cat:", "n_predict": 60,
                                            "temperature": 0, "json_schema": CAT_SCHEMA}).json()
    cat = json.loads(body["content"])
    assert isinstance(cat["name"], str) and isinstance(cat["age"], int)
    assert body["stop_type"] == "eos"


def test_gbnf_grammar_constrains_the_answer(server: Server) -> None:
    grammar = 'root ::= ("yes" | "no") "."'
    events = stream_events(server, "/completion", {
        "prompt": "Is the sky blue? Answer:", "n_predict": 10, "temperature": 0, "stream": True,
        "grammar": grammar, "json_schema": CAT_SCHEMA})  # grammar wins, as in llama.cpp
    assert "".join(e["content"] for e in events) in ("yes.", "no.")
    assert events[-1]["generation_settings"]["grammar"] == grammar
    broken = server.post("/completion", json={"prompt": "x", "grammar": "root ::= ( nothing"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == 400
