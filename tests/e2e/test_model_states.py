"""Load, sleep, wake and unload through the HTTP API, with real engine
processes (pids checked) and the event stream watched throughout."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.lifecycle_support import (
    Background,
    alive,
    card,
    complete,
    held_stream,
    pid,
    status,
    tiny_models_dir,
)
from tests.support.server import Server, running_server, wait_until
from tests.support.sse import SseWatcher

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    directory = tiny_models_dir(tmp_path_factory.mktemp("states") / "models", tiny_model_factory)
    args = ["--models-dir", str(directory), "--models-max", "2", "--model-suspend",
            "--suspend-weights", "host", "--threads", "1"]
    # Keep-alives after 1 s of quiet, not 5: the test of them waits less.
    env = {"ROUNDHOUSE_SSE_KEEPALIVE": "1"}
    with running_server(args, tmp_path_factory.mktemp("states-log") / "router.log",
                        env=env) as running:
        yield running


def unload_all(server: Server) -> None:
    for model in server.get("/models").json()["data"]:
        server.post("/models/unload", json={"model": model["id"]})


def test_load_sleep_wake_unload(server: Server) -> None:
    unload_all(server)
    watcher = SseWatcher(server.url + "/models/sse")
    try:
        # ?wait=1: answer once loaded (without it, once the load has started).
        assert server.post("/models/load", params={"wait": "1"},
                           json={"model": "qwen3-tiny"}).json() == {"success": True}
        first = pid(server, "qwen3-tiny")
        loaded = card(server, "qwen3-tiny")
        assert loaded["status"]["value"] == "loaded"
        assert loaded["meta"]["n_ctx_train"] == 2048 and loaded["max_model_len"] == 2048
        assert "--options" in loaded["status"]["args"]

        assert server.post("/models/sleep", json={"model": "qwen3-tiny"}).json() == {"success": True}
        asleep = card(server, "qwen3-tiny")
        assert asleep["status"]["value"] == "sleeping" and asleep["meta"]["n_ctx"] == 2048
        assert alive(first)  # the process stays

        # A request wakes it: same process, and it answers.
        reply = complete(server, "qwen3-tiny")
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        assert status(server, "qwen3-tiny") == "loaded" and pid(server, "qwen3-tiny") == first

        assert server.post("/models/unload", json={"model": "qwen3-tiny"}).json() == {"success": True}
        assert status(server, "qwen3-tiny") == "unloaded"
        wait_until(lambda: not alive(first), 10, "the engine to exit")
        watcher.wait_for(lambda: watcher.statuses("qwen3-tiny")[-1:] == ["unloaded"], what="unloaded")
        assert watcher.statuses("qwen3-tiny") == [
            "loading", "loaded", "sleeping", "loading", "loaded", "unloading", "unloaded"]
        progress = [e["data"]["progress"]["value"] for e in watcher.events
                    if e["model"] == "qwen3-tiny" and "progress" in e.get("data", {})]
        assert progress and progress[-1] == 1.0 and progress == sorted(progress)
        first_loaded = next(e for e in watcher.events if e["data"]["status"] == "loaded")
        assert first_loaded["data"]["info"]["pid"] == first
    finally:
        watcher.close()


def test_least_recently_used_model_sleeps_to_make_room(server: Server) -> None:
    unload_all(server)
    complete(server, "qwen3-tiny")
    time.sleep(0.05)
    complete(server, "qwen2-tiny")
    qwen3, qwen2 = pid(server, "qwen3-tiny"), pid(server, "qwen2-tiny")
    # --models-max 2: the third model puts the least recently used one to sleep.
    assert complete(server, "llama-tiny").status_code == 200
    assert status(server, "qwen3-tiny") == "sleeping" and alive(qwen3)
    assert status(server, "qwen2-tiny") == "loaded" and status(server, "llama-tiny") == "loaded"
    # Waking qwen3 needs room again: now qwen2 is the least recently used.
    assert complete(server, "qwen3-tiny").status_code == 200
    assert pid(server, "qwen3-tiny") == qwen3
    assert status(server, "qwen2-tiny") == "sleeping" and alive(qwen2)


def test_sleep_refuses_a_busy_model_and_unload_waits_for_it(server: Server) -> None:
    unload_all(server)
    complete(server, "qwen3-tiny")
    engine = pid(server, "qwen3-tiny")
    with held_stream(server, "qwen3-tiny") as stream:
        refused = server.post("/models/sleep", json={"model": "qwen3-tiny"})
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == 409 and refused.json()["error"]["reason"] == "model_busy"
        unloading = Background(server.post, "/models/unload", json={"model": "qwen3-tiny"})
        time.sleep(0.5)
        # The unload waits for the request in flight instead of cancelling it.
        assert not unloading.done and alive(engine)
        assert status(server, "qwen3-tiny") == "unloading"
        assert next(line for line in stream.iter_lines() if line.startswith(b"data: "))
    assert unloading.result().json() == {"success": True}
    wait_until(lambda: not alive(engine), 10, "the engine to exit")


def test_unknown_model_in_the_lifecycle_api(server: Server) -> None:
    response = server.post("/models/load", json={"model": "nope"})
    assert response.status_code == 404
    assert response.json()["error"] == {"code": 404, "message": "model 'nope' not found",
                                        "type": "not_found_error", "reason": "model_not_found"}
    assert server.post("/models/load", data=b"{").status_code == 400


def test_polling_never_wakes_or_loads(server: Server) -> None:
    unload_all(server)
    for _ in range(3):
        server.get("/models")
        server.get("/v1/models")
        server.get("/health")
        server.get("/v1/load")
        # A GET names its model with ?model=, aliases and all, without loading it.
        (one,) = server.get("/v1/load", params={"model": "qwen2-tiny"}).json()["models"]
        assert {k: one[k] for k in ("model", "state", "in_flight")} == {
            "model": "qwen2-tiny", "state": "unloaded", "in_flight": 0}
        assert "capacity" not in one
    assert {m["status"]["value"] for m in server.get("/models").json()["data"]} == {"unloaded"}
    assert server.get("/v1/load", params={"model": "nope"}).status_code == 404


def test_a_request_for_a_loading_model_waits_for_the_same_load(server: Server) -> None:
    unload_all(server)
    watcher = SseWatcher(server.url + "/models/sse")
    try:
        first = Background(complete, server, "llama-tiny")
        second = Background(complete, server, "llama-tiny")
        assert first.result().status_code == 200 and second.result().status_code == 200
        assert watcher.statuses("llama-tiny") == ["loading", "loaded"]
    finally:
        watcher.close()


def test_many_watchers_get_the_same_events_and_keepalives(server: Server) -> None:
    unload_all(server)
    watchers = [SseWatcher(server.url + "/models/sse") for _ in range(3)]
    try:
        server.post("/models/load", json={"model": "qwen2-tiny"})
        for watcher in watchers:
            watcher.wait_for(lambda w=watcher: w.statuses("qwen2-tiny") == ["loading", "loaded"],
                             what="loading, loaded")
        assert watchers[0].events == watchers[1].events == watchers[2].events
        # Quiet streams carry keep-alive comments (ROUNDHOUSE_SSE_KEEPALIVE: 1 s here).
        watchers[0].wait_for(lambda: "keep-alive" in watchers[0].comments, timeout=4,
                             what="a keep-alive")
    finally:
        for watcher in watchers:
            watcher.close()
