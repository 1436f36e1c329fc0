"""Routes and shapes that existing clients expect: the SDKs' models API
(OpenAI's and Anthropic's), llama.cpp's /infill, chat input_tokens and
unprefixed paths, /props and /models fields, and /v1/load in the names
llama.cpp-style load balancers read. A router and a single-model server, both
on the scripted engine."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import Server, running_server, wait_until

pytestmark = pytest.mark.slow

FILLED = "urn 42"
SCRIPT = {"rules": [{"when": "<|fim_middle|>", "reply": FILLED}, *QWEN3_SCRIPT["rules"]],
          "default": QWEN3_SCRIPT["default"]}
HI = [{"role": "user", "content": "hi"}]
PRESET = """
[coder]
alias = c1, c2
tags = code, fim
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path, smollm2_gguf: Path) -> Path:
    directory = tmp_path_factory.mktemp("client-routes") / "models"
    directory.mkdir()
    scripted_model(directory / "coder", tiny_qwen3_dir, SCRIPT)
    scripted_model(directory / "chatty", tiny_qwen3_dir, SCRIPT)
    # No FIM tokens; never loaded here (a refusal comes first).
    (directory / "smollm2.gguf").symlink_to(smollm2_gguf)
    # Its engine finds no script and exits 1 before it is ready.
    (scripted_model(directory / "broken", tiny_qwen3_dir, SCRIPT) / "script.json").unlink()
    return directory


@pytest.fixture(scope="module")
def router(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    preset = models.parent / "preset.ini"
    preset.write_text(PRESET)
    args = ["--models-dir", str(models), "--models-preset", str(preset)]
    with running_server(args, tmp_path_factory.mktemp("client-routes-log") / "router.log",
                        env=ENGINE_ENV) as running:
        yield running


@pytest.fixture(scope="module")
def single(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = [str(models / "coder"), "--alias", "first,second", "--tags", "solo", "--seed", "1234"]
    with running_server(args, tmp_path_factory.mktemp("client-single-log") / "router.log",
                        env=ENGINE_ENV) as running:
        yield running


def statuses(server: Server) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in server.get("/models").json()["data"]}


# ---- the models API of both SDKs ----------------------------------------------------


def test_openai_models_retrieve(router: Server) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    card = client.models.retrieve("coder")
    assert card.id == "coder" and card.object == "model" and card.owned_by == "roundhouse"
    extra = card.model_extra or {}
    assert extra["aliases"] == ["c1", "c2"] and extra["tags"] == ["code", "fim"]
    assert extra["modalities"] == {"input": ["text"], "output": ["text"]}
    assert extra["architecture"]["input_modalities"] == ["text"]
    assert client.models.retrieve("c2").id == "coder"  # an alias resolves
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.code == "model_not_found"
    assert sorted(m.id for m in client.models.list()) == ["broken", "chatty", "coder", "smollm2"]
    # Once loaded, the card has the context under every name clients read.
    client.chat.completions.create(model="coder", messages=HI, max_tokens=2)
    loaded = client.models.retrieve("coder").model_extra or {}
    assert loaded["max_model_len"] == loaded["context_window"] == loaded["meta"]["n_ctx"] > 0


def test_anthropic_models_retrieve_and_list(router: Server) -> None:
    client = anthropic.Anthropic(base_url=router.url, api_key="x", max_retries=0)
    model = client.models.retrieve("c1")
    assert model.type == "model" and model.id == "coder" and model.display_name == "coder"
    assert model.created_at.tzinfo is not None
    assert abs(model.created_at - datetime.datetime.now(datetime.UTC)) < datetime.timedelta(hours=1)
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert caught.value.response.headers["request-id"]
    listed = client.models.with_raw_response.list()
    assert listed.headers["request-id"] and listed.headers["content-type"].startswith("application/json")
    # Pages of one, followed by the SDK with after_id.
    first = client.models.list(limit=1)
    assert first.has_more is True and len(first.data) == 1
    assert [m.id for m in client.models.list(limit=1)] == ["broken", "chatty", "coder", "smollm2"]
    page = router.get("/v1/models", params={"limit": 2, "after_id": "chatty"},
                      headers={"anthropic-version": "2023-06-01"}).json()
    assert page == {"data": page["data"], "has_more": False, "first_id": "coder", "last_id": "smollm2"}
    before = router.get("/v1/models", params={"before_id": "coder"},
                        headers={"anthropic-version": "2023-06-01"}).json()
    assert [m["id"] for m in before["data"]] == ["broken", "chatty"]
    bad = router.get("/v1/models", params={"limit": 0}, headers={"anthropic-version": "2023-06-01"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


# ---- llama.cpp's routes ----------------------------------------------------------------


def test_infill_builds_the_fim_prompt(router: Server) -> None:
    reply = router.post("/infill", json={
        "model": "coder", "input_prefix": "def f():\n", "input_suffix": "\nprint(f())\n",
        "prompt": "    ret", "input_extra": [{"filename": "a.py", "text": "X = 1\n"}],
        "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["prompt"] == (
        "<|repo_name|>myproject\n<|file_sep|>a.py\nX = 1\n<|file_sep|>filename\n"
        "<|fim_prefix|>def f():\n    ret<|fim_suffix|>\nprint(f())\n<|fim_middle|>")
    assert body["content"] == FILLED and body["stop"] is True and body["model"] == "coder"
    assert body["tokens_predicted"] > 0 and "timings" in body


def test_infill_refusals(router: Server) -> None:
    before = statuses(router)["smollm2"]
    refused = router.post("/infill", json={"model": "smollm2", "input_prefix": "a", "input_suffix": "b"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == 400 and error["type"] == "not_supported_error"
    assert error["message"] == ("Infill is not supported by this model: prefix token is missing. "
                                "suffix token is missing. middle token is missing. ")
    assert statuses(router)["smollm2"] == before == "unloaded"
    missing = router.post("/infill", json={"model": "coder", "input_prefix": "a"})
    assert missing.status_code == 400 and "input_suffix" in missing.json()["error"]["message"]
    chunk = router.post("/infill", json={"model": "coder", "input_prefix": "a", "input_suffix": "b",
                                         "input_extra": [{"filename": "x.py"}]})
    assert chunk.status_code == 400 and chunk.json()["error"]["code"] == 400


def test_chat_input_tokens_count_without_loading(router: Server) -> None:
    assert statuses(router)["chatty"] == "unloaded"
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        reply = router.post(path, json={"model": "chatty", "messages": HI})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "response.input_tokens" and body["input_tokens"] > 0
    assert statuses(router)["chatty"] == "unloaded"
    used = router.post("/chat/completions", json={"model": "chatty", "messages": HI, "max_tokens": 1})
    assert used.json()["usage"]["prompt_tokens"] == body["input_tokens"]
    bad = router.post("/chat/completions/input_tokens", json={"model": "chatty"})
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}


def test_unprefixed_responses(router: Server) -> None:
    reply = router.post("/responses", json={"model": "chatty", "input": "hi", "max_output_tokens": 4})
    assert reply.status_code == 200 and reply.json()["object"] == "response"
    count = router.post("/responses/input_tokens", json={"model": "chatty", "input": "hi"})
    assert count.json()["object"] == "response.input_tokens"


def test_router_props_and_cards(router: Server) -> None:
    props = router.get("/props").json()
    assert props["role"] == "router" and props["webui_settings"] == {}
    assert props["build_info"].startswith("b") and props["build_info"].endswith("-roundhouse")
    model = router.get("/props", params={"model": "c1"}).json()
    assert model["build_info"] == props["build_info"] and model["webui_settings"] == {}
    # No --seed: a random one per request, written as llama.cpp writes -1.
    assert model["default_generation_settings"]["params"]["seed"] == 0xFFFFFFFF
    cards = {m["id"]: m for m in router.get("/models").json()["data"]}
    assert cards["coder"]["tags"] == ["code", "fim"] and cards["chatty"]["tags"] == []
    assert cards["coder"]["name"] == "coder"


def test_a_failed_load_shows_in_the_card(router: Server) -> None:
    router.post("/models/load", json={"model": "broken"})

    def card() -> dict:
        return {m["id"]: m for m in router.get("/models").json()["data"]}["broken"]["status"]

    wait_until(lambda: card().get("failed") is True, 30, "the load to fail", router)
    status = card()
    assert status["value"] == "unloaded" and status["failed"] is True and status["exit_code"] == 1
    assert status["args"] and "script.json" in status["error"]


def test_router_load_is_a_list_in_balancer_names(router: Server) -> None:
    router.post("/completion", json={"model": "coder", "prompt": "hi", "n_predict": 1})
    body = router.get("/v1/load").json()
    assert body["object"] == "list" and body["uptime_seconds"] >= 0
    coder = {m["model"]: m for m in body["models"]}["coder"]
    assert coder["object"] == "load" and coder["state"] == "loaded"
    assert set(coder["capacity"]) == {"max_concurrency", "max_pending_requests", "max_context",
                                      "kv_capacity_tokens", "kv_capacity_pages", "kv_page_tokens"}
    capacity = coder["capacity"]
    assert capacity["kv_capacity_tokens"] == capacity["kv_capacity_pages"] * capacity["kv_page_tokens"]
    assert set(coder["requests"]) == {"admitted", "running", "prefilling", "waiting"}
    assert set(coder["occupancy"]) == {"kv_pages", "kv_tokens", "kv_fraction", "lane_fraction",
                                       "host_kv_pages", "host_kv_capacity_pages",
                                       "disk_kv_pages", "disk_kv_bytes", "disk_kv_capacity_bytes"}
    stats = router.get("/stats", params={"model": "c1"}).json()
    (one,) = stats["models"]
    assert one["model"] == "coder" and "peak_admitted" in one and "queue" in one


# ---- a single-model server -----------------------------------------------------------


def test_single_model_server_answers_as_its_first_alias(single: Server) -> None:
    (card,) = single.get("/models").json()["data"]
    assert card["id"] == "first" and card["name"] == "coder" and card["path"].endswith("coder")
    assert card["aliases"] == ["first", "second"] and card["tags"] == ["solo"]
    client = openai.OpenAI(base_url=single.url + "/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("second").id == "first"
    props = single.get("/props").json()
    assert props["model_alias"] == "first" and props["webui_settings"] == {}
    assert props["build_info"].endswith("-roundhouse")
    assert props["default_generation_settings"]["params"]["seed"] == 1234


def test_single_model_load_is_one_object(single: Server) -> None:
    wait_until(lambda: single.get("/v1/load").json().get("state") == "loaded", 30, "the model to load")
    body = single.get("/v1/load").json()
    assert body["object"] == "load" and body["model"] == "first" and body["uptime_seconds"] >= 0
    assert "models" not in body
    assert body["capacity"]["max_concurrency"] == 8 and body["requests"]["admitted"] == 0
    assert body["occupancy"]["lane_fraction"] == 0
    stats = single.get("/stats").json()
    assert stats["model"] == "first" and stats["peak_admitted"] == 0
