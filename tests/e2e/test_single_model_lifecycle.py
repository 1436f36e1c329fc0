"""A single-model server: 503s until ready, idle timers, shutdown and exit
statuses for its supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.lifecycle_support import alive, pid, status
from tests.support.broken_model import UNKNOWN_ARCHITECTURE, write_broken_model
from tests.support.server import Server, free_port, running_server, wait_until

pytestmark = pytest.mark.slow


def start(args: list[str], log: Path) -> Server:
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "router", "serve", "--port", str(port), *args],
                                   stdout=out, stderr=subprocess.STDOUT)
    return Server(process, port, log)


def http_status(url: str) -> int:
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return 0


def test_every_route_answers_503_until_the_model_is_ready(tmp_path: Path, smollm2_gguf: Path) -> None:
    server = start([str(smollm2_gguf), "--threads", "1"], tmp_path / "router.log")
    try:
        wait_until(lambda: http_status(server.url + "/health") != 0, 15, "the port", server)
        chat = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        models = server.get("/models")
        openai_models = server.get("/v1/models")
        health = server.get("/health")
        for response in (chat, models, openai_models, health):
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"] == "1"
        assert chat.json()["error"]["code"] == "model_loading"
        assert openai_models.json()["error"]["code"] == "model_loading"
        assert models.json()["error"] == {"code": 503, "message": "Loading model",
                                          "type": "unavailable_error", "reason": "model_loading"}
        assert health.json()["error"]["code"] == 503
        wait_until(lambda: http_status(server.url + "/health") == 200, 120, "the model", server)
        assert server.get("/v1/models").status_code == 200
    finally:
        server.process.kill()
        server.process.wait()


def test_idle_timers_sleep_then_unload(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    # Asleep after 1 s, unloaded after 3: a 2 s window to see it sleeping.
    args = [str(tiny_qwen3_dir), "--threads", "1", "--sleep-idle-seconds", "1",
            "--unload-idle-seconds", "3"]
    with running_server(args, tmp_path / "router.log") as server:
        name = "tiny-qwen3"
        body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
        assert server.post("/v1/completions", json=body).status_code == 200
        engine = pid(server, name)
        # Polling does not count as use: the model still falls asleep.
        deadline = time.monotonic() + 10
        while status(server, name) != "sleeping":
            assert time.monotonic() < deadline, "never fell asleep"
            server.get("/v1/load")
            time.sleep(0.1)
        assert alive(engine)
        assert server.post("/v1/completions", json=body).status_code == 200
        assert pid(server, name) == engine and status(server, name) == "loaded"
        wait_until(lambda: status(server, name) == "unloaded", 20, "the idle unload")
        wait_until(lambda: not alive(engine), 10, "the engine to exit")
        # The next request loads it again.
        assert server.post("/v1/completions", json=body).status_code == 200
        assert pid(server, name) != engine


def test_sigterm_ends_requests_stops_engines_and_exits_zero(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    # A stream that would run for minutes outlives a 1 s grace (tests/e2e/test_shutdown_drain.py).
    args = [str(tiny_qwen3_dir), "--threads", "1", "--shutdown-grace-seconds", "1"]
    with running_server(args, tmp_path / "router.log") as server:
        body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        stream = requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60)
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        engine = pid(server, "tiny-qwen3")
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith(b"data: ")]
        errors = [json.loads(line[6:]) for line in rest if line.startswith(b'data: {"error"')]
        assert errors and errors[0]["error"]["code"] == "shutting_down"
        assert rest[-1] == b"data: [DONE]"
        assert server.process.wait(30) == 0
        wait_until(lambda: not alive(engine), 10, "the engine to stop")


def test_an_engine_failure_exits_two(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    with running_server([str(tiny_qwen3_dir), "--threads", "1"], tmp_path / "router.log") as server:
        os.kill(pid(server, "tiny-qwen3"), signal.SIGKILL)
        assert server.process.wait(30) == 2


def test_a_model_that_cannot_load_exits_one(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    broken = write_broken_model(tmp_path / "broken", tiny_qwen3_dir)
    server = start([str(broken), "--threads", "1"], tmp_path / "router.log")
    assert server.process.wait(60) == 1
    assert UNKNOWN_ARCHITECTURE in server.log()
