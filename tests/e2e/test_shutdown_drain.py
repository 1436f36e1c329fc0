"""SIGTERM drains: running streams finish within --shutdown-grace-seconds,
queued and new requests get 503 shutting_down, what outlives the grace ends
with an error event, each request is logged with its real outcome, and the
server exits 0. Scripted engines make the timing certain."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import requests

from tests.e2e.lifecycle_support import Background
from tests.support.scripted_models import ENGINE_ENV, scripted_model
from tests.support.server import Server, running_server, wait_until

pytestmark = pytest.mark.slow

# 20 ms a step (more on a busy machine): "medium" takes seconds, "long" long
# past a 1 s grace.
SCRIPT = {"step_seconds": 0.02,
          "rules": [{"when": "medium", "reply": "word " * 80},
                    {"when": "long", "reply": "word " * 800}],
          "default": "Short answer."}


def open_stream(server: Server, prompt: str) -> requests.Response:
    body = {"prompt": prompt, "max_tokens": 2000, "stream": True}
    response = requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60)
    assert response.status_code == 200, response.text
    return response


def short(server: Server) -> requests.Response:
    return server.post("/v1/completions", json={"prompt": "hello", "max_tokens": 20})


def data_lines(lines) -> list[bytes]:  # type: ignore[no-untyped-def]
    return [line for line in lines if line.startswith(b"data: ")]


def request_lines(server: Server) -> list[str]:
    return [line for line in server.log().splitlines() if " request req-" in line]


def test_a_running_stream_finishes_and_new_requests_get_503(tmp_path: Path,
                                                            tiny_qwen3_dir: Path) -> None:
    model = scripted_model(tmp_path / "model", tiny_qwen3_dir, SCRIPT)
    args = [str(model), "--max-concurrency", "1", "--shutdown-grace-seconds", "30"]
    with running_server(args, tmp_path / "router.log", env=ENGINE_ENV) as server:
        stream = open_stream(server, "tell me something medium")
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        queued = Background(short, server)
        wait_until(lambda: server.load()["model"]["requests"]["waiting"] == 1, 10,
                   "a request waiting for the lane", server)
        server.process.send_signal(signal.SIGTERM)

        # Not yet submitted: refused at once, and told when to come back.
        refused = queued.result()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["Retry-After"]
        late = short(server)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert late.headers["Retry-After"]
        # Load balancers see it leave rotation.
        health = server.get("/health")
        assert health.status_code == 503 and health.json()["error"]["reason"] == "shutting_down"

        rest = data_lines(lines)
        assert rest[-1] == b"data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        assert not [c for c in chunks if "error" in c]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert server.process.wait(30) == 0
    assert "engine for model stopped (exit status 0)" in server.log()
    logged = request_lines(server)
    assert len([line for line in logged if " done 200 " in line]) == 1, logged
    assert len([line for line in logged if "rejected 503 shutting_down" in line]) == 2, logged


def test_a_stream_that_outlives_the_grace_ends_with_an_error(tmp_path: Path,
                                                             tiny_qwen3_dir: Path) -> None:
    model = scripted_model(tmp_path / "model", tiny_qwen3_dir, SCRIPT)
    args = [str(model), "--shutdown-grace-seconds", "1"]
    with running_server(args, tmp_path / "router.log", env=ENGINE_ENV) as server:
        stream = open_stream(server, "tell me something long")
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        server.process.send_signal(signal.SIGTERM)
        rest = data_lines(lines)
        assert rest[-1] == b"data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "shutting_down" and "--shutdown-grace-seconds" in error["message"]
        assert server.process.wait(30) == 0
    assert "engine for model stopped (exit status 0)" in server.log()
    logged = request_lines(server)
    assert any(" error " in line and "shutting_down" in line for line in logged), logged
    assert not [line for line in logged if " done 200 " in line], logged
