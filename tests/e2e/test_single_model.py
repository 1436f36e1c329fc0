"""`roundhouse serve` with no model: the default model, as `make serve` runs it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.support.server import Server, free_port, running_server, wait_until

pytestmark = pytest.mark.slow


def engine_pid(server: Server) -> int:
    (model,) = server.load().values()
    return model["pid"]


def test_default_model_answers_the_readme_question(tmp_path: Path, smollm2_gguf: Path) -> None:
    port = free_port()
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "router", "serve", "--port", str(port),
                                    "--threads", "1"], stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, port, log)
    try:
        url = f"http://127.0.0.1:{port}"
        # The port is bound before the model loads: /health answers 503 until it is ready.
        wait_until(lambda: _status(url + "/health") in (200, 503), 10, "the port to be bound", server)
        first = _status(url + "/health")
        wait_until(lambda: _status(url + "/health") == 200, 120, "the model to load", server)
        assert first in (200, 503)
        # What the README's curl sends: no model, no sampling settings.
        reply = requests.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
        assert "Paris" in reply["choices"][0]["message"]["content"], reply
        # A single-model server takes any model name, as llama.cpp's does.
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        named = client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert named.model == "SmolLM2-135M-Instruct.Q4_1"
        assert "loading" in log.read_text() and "100%" in log.read_text()

        pid = engine_pid(server)
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        assert process.returncode == 0
        wait_until(lambda: not _alive(pid), 10, "the engine to stop with the router")
    finally:
        if process.poll() is None:
            process.kill()


def test_engines_die_with_a_killed_router(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    with running_server([str(tiny_qwen3_dir), "--threads", "1"], tmp_path / "router.log") as server:
        pid = engine_pid(server)
        server.process.kill()
        server.process.wait()
        wait_until(lambda: not _alive(pid), 10, "the orphaned engine to exit")


def test_a_port_clash_is_reported_at_once(tiny_qwen3_server: Server, tiny_qwen3_dir: Path) -> None:
    # The package's running server (tests/e2e/conftest.py) holds the port.
    started = time.monotonic()
    clash = subprocess.run(
        [sys.executable, "-m", "router", "serve", str(tiny_qwen3_dir), "--port",
         str(tiny_qwen3_server.port)], capture_output=True, text=True, timeout=60)
    assert clash.returncode != 0
    assert "address already in use" in clash.stderr.lower()
    assert time.monotonic() - started < 10
    assert tiny_qwen3_server.get("/health").status_code == 200


def _status(url: str) -> int:
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return 0


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
