"""Faults and explicit operations, with scripted engines: an engine killed
while requests queue, a load that fails after POST /models/load answered,
names a single-model server refuses, autoload off, llama.cpp's /models
download and delete routes."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.e2e.lifecycle_support import Background, card, status
from tests.support.scripted_models import ENGINE_ENV, scripted_model
from tests.support.server import Server, running_server, wait_until
from tests.support.sse import SseWatcher

pytestmark = pytest.mark.slow

# 20 ms a token: a "long" answer takes about 8 s, a short one a fraction of one.
SLOW_SCRIPT = {"step_seconds": 0.02, "rules": [{"when": "long", "reply": "word " * 400}],
               "default": "Short answer."}


def slow_model(directory: Path, base: Path) -> Path:
    return scripted_model(directory / "slow", base, SLOW_SCRIPT)


def broken_model(directory: Path, base: Path) -> Path:
    """Fails in its engine, after the router read its tokenizer: the scripted
    engine exits 1 without its script."""
    model = scripted_model(directory / "broken", base, {})
    (model / "script.json").unlink()
    return model


def complete(server: Server, prompt: str, model: str = "slow", **query: str) -> requests.Response:
    return server.post("/v1/completions", params=query or None,
                       json={"model": model, "prompt": prompt, "max_tokens": 500})


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("faults") / "models"
    models.mkdir()
    slow_model(models, tiny_qwen3_dir)
    broken_model(models, tiny_qwen3_dir)
    args = ["--models-dir", str(models), "--max-concurrency", "1", "--models-max", "2"]
    with running_server(args, tmp_path_factory.mktemp("faults-log") / "router.log",
                        env=ENGINE_ENV) as server:
        yield server


def test_an_engine_killed_while_requests_queue(router: Server) -> None:
    assert complete(router, "hello").status_code == 200
    first = router.load()["slow"]["pid"]
    watcher = SseWatcher(router.url + "/models/sse")
    try:
        body = {"model": "slow", "prompt": "tell me something long", "max_tokens": 500,
                "stream": True}
        stream = requests.post(router.url + "/v1/completions", json=body, stream=True, timeout=60)
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        # Two more wait for the only lane; nothing of theirs reached the engine.
        queued = [Background(complete, router, "hello") for _ in range(2)]
        wait_until(lambda: router.load()["slow"]["requests"]["waiting"] == 2, 10,
                   "two requests waiting for the lane", router)
        os.kill(first, signal.SIGKILL)

        rest = [line for line in lines if line.startswith(b"data: ")]
        errors = [json.loads(line[6:]) for line in rest if line.startswith(b'data: {"error"')]
        assert errors and errors[0]["error"]["code"] == "engine_failed", rest[-3:]
        # The queued ones run on the engine that replaces it.
        for request in queued:
            answer = request.result()
            assert answer.status_code == 200, answer.text
        assert router.load()["slow"]["pid"] != first
        # The crash is reported as llama.cpp's router does: failed, with the exit code.
        watcher.wait_for(lambda: any(e["data"].get("failed") for e in watcher.events
                                     if e["model"] == "slow"), what="the failure event")
        failure = next(e["data"] for e in watcher.events
                       if e["model"] == "slow" and e["data"].get("failed"))
        assert failure["status"] == "unloaded" and failure["exit_code"] == -signal.SIGKILL
    finally:
        watcher.close()
    assert " 500 " not in router.log() and "internal_error" not in router.log()


def test_load_answers_at_once_and_a_failed_load_shows_in_models(router: Server) -> None:
    watcher = SseWatcher(router.url + "/models/sse")
    try:
        # llama.cpp answers at once; the outcome is for GET /models and the SSE stream.
        assert router.post("/models/load", json={"model": "broken"}).json() == {"success": True}
        wait_until(lambda: card(router, "broken")["status"].get("failed") is True, 30,
                   "the failed load in /models", router)
        failed = card(router, "broken")["status"]
        assert failed["value"] == "unloaded" and failed["exit_code"] == 1
        assert "script.json" in failed["error"]
        watcher.wait_for(lambda: watcher.statuses("broken") == ["loading", "unloaded"],
                         what="loading, unloaded")
        event = [e["data"] for e in watcher.events if e["model"] == "broken"][-1]
        assert event["failed"] is True and event["exit_code"] == 1
    finally:
        watcher.close()
    # ?wait=1 waits, and says how it went.
    waited = router.post("/models/load", params={"wait": "1"}, json={"model": "broken"})
    assert waited.status_code == 503 and waited.json()["error"]["reason"] == "model_load_failed"


def test_load_of_an_unloaded_model_does_not_wait_for_it(router: Server) -> None:
    router.post("/models/unload", json={"model": "slow"})
    assert status(router, "slow") == "unloaded"
    assert router.post("/models/load", json={"model": "slow"}).json() == {"success": True}
    # The engine process has not even started up yet.
    assert status(router, "slow") == "loading"
    wait_until(lambda: status(router, "slow") == "loaded", 30, "the load", router)


def test_llamacpp_download_and_delete_routes_are_refused(router: Server) -> None:
    for method in ("POST", "DELETE"):
        response = requests.request(method, router.url + "/models", params={"model": "slow"},
                                    json={"model": "slow"}, timeout=10)
        assert response.status_code == 405, response.text
        assert response.headers["Allow"] == "GET, HEAD"
        error = response.json()["error"]
        assert error["reason"] == "not_supported" and "/models/load" in error["message"]
    assert status(router, "slow") in ("loaded", "unloaded")


def test_autoload_off_is_a_400_that_says_how_to_load(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    slow_model(models, tiny_qwen3_dir)
    args = ["--models-dir", str(models), "--no-models-autoload"]
    with running_server(args, tmp_path / "router.log", env=ENGINE_ENV) as server:
        refused = complete(server, "hello")
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_not_loaded" and "POST /models/load" in error["message"]
        assert status(server, "slow") == "unloaded"
        assert server.post("/models/load", params={"wait": "1"},
                           json={"model": "slow"}).json() == {"success": True}
        assert complete(server, "hello").status_code == 200


def test_a_single_model_server_refuses_other_names(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    model = slow_model(tmp_path, tiny_qwen3_dir)
    with running_server([str(model)], tmp_path / "router.log", env=ENGINE_ENV) as server:
        for operation in ("unload", "sleep", "load"):
            refused = server.post(f"/models/{operation}", json={"model": "gpt-4"})
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["reason"] == "model_not_found"
        assert status(server, "slow") == "loaded"
        assert server.post("/models/unload", json={"model": "slow"}).json() == {"success": True}
        assert status(server, "slow") == "unloaded"
        # No name: the model.
        assert server.post("/models/load", params={"wait": "1"}, json={}).json() == {
            "success": True}
        assert status(server, "slow") == "loaded"
        assert complete(server, "hello").status_code == 200
