"""--models-max 1: busy models are never evicted, waiting requests are served
in arrival order within --pending-timeout-ms, and ?autoload=0 refuses.

The busy model is SmolLM2: on this CPU it keeps a stream going for minutes,
where a tiny model reaches the end of its context in seconds."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.lifecycle_support import (
    Background,
    alive,
    complete,
    held_stream,
    pid,
    status,
    tiny_models_dir,
)
from tests.support.server import Server, running_server
from tests.support.sse import SseWatcher

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory, smollm2_gguf) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    directory = tiny_models_dir(tmp_path_factory.mktemp("room") / "models", tiny_model_factory, smollm2_gguf)
    args = ["--models-dir", str(directory), "--models-max", "1", "--pending-timeout-ms", "6000",
            "--threads", "1"]
    with running_server(args, tmp_path_factory.mktemp("room-log") / "router.log") as running:
        yield running


def test_busy_model_is_not_evicted_and_waiters_are_served_in_order(server: Server) -> None:
    complete(server, "smollm2")
    busy = pid(server, "smollm2")
    watcher = SseWatcher(server.url + "/models/sse")
    try:
        with held_stream(server, "smollm2"):
            second = Background(complete, server, "qwen2-tiny")
            time.sleep(0.3)
            third = Background(complete, server, "llama-tiny")
            time.sleep(1.0)
            # Both wait; the busy model keeps running.
            assert not second.done and not third.done
            assert status(server, "smollm2") == "loaded" and alive(busy)
            assert status(server, "qwen2-tiny") == "unloaded"
            assert status(server, "llama-tiny") == "unloaded"
        assert second.result().status_code == 200
        assert third.result().status_code == 200
        order = [(e["model"], e["data"]["status"]) for e in watcher.events
                 if e["event"] == "model_status" and "progress" not in e["data"]]
        assert order == [
            ("smollm2", "unloading"), ("smollm2", "unloaded"),
            ("qwen2-tiny", "loading"), ("qwen2-tiny", "loaded"),
            ("qwen2-tiny", "unloading"), ("qwen2-tiny", "unloaded"),
            ("llama-tiny", "loading"), ("llama-tiny", "loaded"),
        ]
    finally:
        watcher.close()


def test_waiting_is_bounded_by_the_pending_timeout(server: Server) -> None:
    complete(server, "smollm2")
    with held_stream(server, "smollm2"):
        started = time.monotonic()
        refused = complete(server, "qwen2-tiny")
        waited = time.monotonic() - started
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "models_busy"
    assert refused.headers["Retry-After"] == "1"
    assert 5.5 < waited < 15


def test_a_client_that_leaves_gives_up_its_place(server: Server) -> None:
    complete(server, "smollm2")
    with held_stream(server, "smollm2"):
        import requests

        # This one gives up after a second; the one behind it must still be served.
        with pytest.raises(requests.Timeout):
            requests.post(server.url + "/v1/completions", timeout=1,
                          json={"model": "qwen2-tiny", "prompt": "hi", "max_tokens": 1})
        behind = Background(complete, server, "llama-tiny")
        time.sleep(0.5)
    assert behind.result().status_code == 200
    assert status(server, "llama-tiny") == "loaded"
    assert status(server, "qwen2-tiny") == "unloaded"


def test_autoload_off_per_request(server: Server) -> None:
    complete(server, "qwen3-tiny")
    refused = complete(server, "qwen2-tiny", autoload="0")
    # llama.cpp's router answers 400: the client must load the model first.
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_loaded"
    assert status(server, "qwen2-tiny") == "unloaded"
    assert complete(server, "qwen2-tiny", autoload="1").status_code == 200
