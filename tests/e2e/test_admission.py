"""Admission control with real concurrent clients: lanes, the bounded queue,
queue timeouts, body limits, output budgets, and the load snapshots."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import requests

from tests.e2e.lifecycle_support import Background
from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import Server, running_server, wait_until

pytestmark = pytest.mark.slow

LONG = [{"role": "user", "content": "Tell me a long story"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    models = tmp_path_factory.mktemp("admission") / "models"
    models.mkdir()
    scripted_model(models / "one-lane", tiny_qwen3_dir, QWEN3_SCRIPT)
    args = ["--models-dir", str(models), "--max-concurrency", "1", "--max-pending-requests", "1",
            "--pending-timeout-ms", "1500", "--max-request-mib", "0.05"]
    with running_server(args, tmp_path_factory.mktemp("admission-log") / "router.log",
                        env=ENGINE_ENV) as running:
        yield running


def chat(server: Server, **extra: object) -> requests.Response:
    return server.post("/v1/chat/completions", json={"model": "one-lane", "messages": LONG, **extra})


def anthropic(server: Server) -> requests.Response:
    return server.post("/v1/messages", json={"model": "one-lane", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": "hi"}]})


def hold_the_lane(server: Server) -> requests.Response:
    """A streamed long answer, kept open: it holds the model's only lane."""
    body = {"model": "one-lane", "messages": LONG, "stream": True, "max_tokens": -1}
    response = requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=60)
    # Keep the line iterator alive: dropping it closes the connection.
    lines = response.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))
    response.lines = lines  # type: ignore[attr-defined]
    return response


def test_a_full_queue_answers_429_and_anthropic_529(server: Server) -> None:
    holder = hold_the_lane(server)
    try:
        waiting = Background(chat, server, max_tokens=2)
        wait_until(lambda: server.get("/v1/load").json()["models"][0]["requests"]["waiting"] == 1,
                   10, "the second request to queue", server)
        overloaded = chat(server, max_tokens=2)
        assert overloaded.status_code == 429
        assert overloaded.json()["error"]["code"] == "server_overloaded"
        assert overloaded.headers["Retry-After"] == "1"
        claude = anthropic(server)
        assert claude.status_code == 529
        assert claude.json()["error"]["type"] == "overloaded_error"
        load = server.get("/v1/load").json()["models"][0]
        assert load["requests"]["admitted"] == 1 and load["requests"]["waiting"] == 1
        assert load["capacity"]["max_concurrency"] == 1
        assert load["capacity"]["max_pending_requests"] == 1
        stats = server.get("/stats").json()["models"][0]
        assert stats["peak_admitted"] == 1 and stats["queue"][0]["waited_seconds"] > 0
    finally:
        holder.close()
    assert waiting.result().status_code == 200


def test_waiting_too_long_is_503_and_anthropic_504(server: Server) -> None:
    holder = hold_the_lane(server)
    try:
        started = time.monotonic()
        timed_out = chat(server, max_tokens=2)
        waited = time.monotonic() - started
        assert timed_out.status_code == 503
        assert timed_out.json()["error"]["code"] == "request_queue_timeout"
        assert 1.2 < waited < 10
        claude = anthropic(server)
        assert claude.status_code == 504 and claude.json()["error"]["type"] == "timeout_error"
    finally:
        holder.close()


def test_a_body_over_the_limit_is_413_in_each_shape(server: Server) -> None:
    big = "x" * 80_000  # --max-request-mib 0.05 is 52,428 bytes
    openai = chat(server, padding=big)
    assert openai.status_code == 413 and openai.json()["error"]["code"] == "request_too_large"
    claude = server.post("/v1/messages", json={"model": "one-lane", "max_tokens": 1, "padding": big,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert claude.status_code == 413 and claude.json()["error"]["type"] == "request_too_large"
    native = server.post("/completion", json={"prompt": big})
    assert native.status_code == 413 and native.json()["error"]["code"] == 413
    assert chat(server, max_tokens=2).status_code == 200


def test_the_snapshots_answer_while_the_engine_is_busy(server: Server) -> None:
    holder = hold_the_lane(server)
    try:
        started = time.monotonic()
        for _ in range(5):
            assert server.get("/v1/load").status_code == 200
        assert time.monotonic() - started < 2
        counters = server.get("/v1/load").json()["models"][0]["counters"]
        wait_until(lambda: server.get("/v1/load").json()["models"][0]["counters"]["generated_tokens"]
                   > counters["generated_tokens"], 10, "the counters to advance", server)
    finally:
        holder.close()


def test_without_a_limit_the_answer_runs_to_its_end(tmp_path, tiny_qwen3_dir) -> None:  # type: ignore[no-untyped-def]
    models = tmp_path / "models"
    models.mkdir()
    # Nothing here acts mid-stream: the long story's 1,000-odd steps run unpaced.
    scripted_model(models / "many-lanes", tiny_qwen3_dir, {**QWEN3_SCRIPT, "step_seconds": 0})
    # 64 lanes share the scripted engine's 16,384-token pool (256 each): no
    # longer a cap, the context left after the prompt is (router/output_budget.py).
    args = ["--models-dir", str(models), "--max-concurrency", "64", "--max-batched-tokens", "512"]
    with running_server(args, tmp_path / "router.log", env=ENGINE_ENV) as many:
        body = {"model": "many-lanes", "messages": LONG}
        reply = many.post("/v1/chat/completions", json=body).json()
        assert reply["usage"]["completion_tokens"] > 1000
        assert reply["choices"][0]["finish_reason"] == "stop"
        # -1 (llama.cpp's web UI default) is no limit but the context too.
        unlimited = many.post("/v1/chat/completions", json={**body, "max_tokens": -1}).json()
        assert unlimited["usage"] == reply["usage"]
        # An explicit limit wins.
        reply = many.post("/v1/chat/completions", json={**body, "max_tokens": 300}).json()
        assert reply["usage"]["completion_tokens"] == 300
    with running_server([*args, "--default-max-tokens", "7"], tmp_path / "router2.log",
                        env=ENGINE_ENV) as fixed:
        reply = fixed.post("/v1/chat/completions", json={"model": "many-lanes", "messages": LONG}).json()
        assert reply["usage"]["completion_tokens"] == 7


def test_token_counting_has_its_own_bound(tmp_path, tiny_qwen3_dir) -> None:  # type: ignore[no-untyped-def]
    import concurrent.futures

    models = tmp_path / "models"
    models.mkdir()
    scripted_model(models / "m", tiny_qwen3_dir, QWEN3_SCRIPT)
    args = ["--models-dir", str(models), "--max-token-count-requests", "1"]
    with running_server(args, tmp_path / "router.log", env=ENGINE_ENV) as gated:
        # Long prompts keep each count busy long enough to overlap.
        body = {"model": "m", "messages": [{"role": "user", "content": "word " * 60_000}]}

        def count(route: str) -> int:
            payload = {**body, "max_tokens": 1} if "messages" in route else body
            return requests.post(gated.url + route, json=payload, timeout=60).status_code

        routes = ["/v1/messages/count_tokens"] * 12
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(count, routes))
        assert 200 in statuses and 529 in statuses, statuses
        assert set(statuses) <= {200, 529}
        # Generation is not counted against it.
        reply = gated.post("/v1/chat/completions", json={"model": "m", "messages": LONG, "max_tokens": 2})
        assert reply.status_code == 200
