"""Loading, switching, failing and aborting, watched from outside the server."""

from __future__ import annotations

import os
import signal
import time

import openai
import psutil
import pytest
import requests

from tests.support.server import Server, wait_until
from tests.support.sse import SseWatcher

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]


def engine_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_models_max_one_unloads_the_first_engine(client: openai.OpenAI, router: Server) -> None:
    client.chat.completions.create(model="smollm2", messages=HI, max_tokens=1)
    first = router.load()["smollm2"]
    assert first["state"] == "loaded"
    first_pid = first["pid"]
    assert engine_alive(first_pid)

    client.chat.completions.create(model="qwen3-tiny", messages=HI, max_tokens=1)
    load = router.load()
    assert load["smollm2"]["state"] == "unloaded" and "pid" not in load["smollm2"]
    assert load["qwen3-tiny"]["state"] == "loaded"
    wait_until(lambda: not engine_alive(first_pid), 10, "the first engine to exit")
    statuses = {m["id"]: m["status"]["value"] for m in router.get("/v1/models").json()["data"]}
    assert statuses == {"smollm2": "unloaded", "qwen3-tiny": "loaded", "broken": "unloaded"}


def test_a_client_that_disconnects_aborts_its_request(router: Server) -> None:
    body = {"model": "qwen3-tiny", "messages": HI, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with requests.post(router.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(8)]
        assert all(line.startswith(b"data: ") or line == b"" for line in received)
        running = router.load()["qwen3-tiny"]["requests"]["running"]
        assert running == 1
    # Closing the connection must end the request in the engine promptly.
    wait_until(lambda: router.load()["qwen3-tiny"]["requests"]["running"] == 0, 5,
               "the engine to drop the aborted request", router)
    generated = router.load()["qwen3-tiny"]["counters"]["generated_tokens"]
    time.sleep(0.5)
    assert router.load()["qwen3-tiny"]["counters"]["generated_tokens"] == generated
    assert generated < 1500


def test_a_model_that_fails_to_load_is_reported_and_retried(client: openai.OpenAI, router: Server) -> None:
    watcher = SseWatcher(router.url + "/models/sse")
    for _ in range(2):  # the second request tries again
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="broken", messages=HI, max_tokens=1)
        assert caught.value.status_code == 503
        assert caught.value.code == "model_load_failed"
        assert "NoSuchModelForCausalLM" in caught.value.message
    card = next(m for m in router.get("/v1/models").json()["data"] if m["id"] == "broken")
    assert card["status"]["value"] == "unloaded" and card["status"]["failed"] is True
    assert "NoSuchModelForCausalLM" in card["status"]["error"]
    assert card["status"]["exit_code"] == 1
    # Both failures on the stream before it is closed (close() ends it at once).
    watcher.wait_for(lambda: watcher.statuses("broken") == ["loading", "unloaded"] * 2,
                     what="two failed loads")
    watcher.close()
    failures = [e["data"] for e in watcher.events if e["model"] == "broken" and e["data"]["status"] == "unloaded"]
    assert len(failures) == 2 and all(f["failed"] and "NoSuchModelForCausalLM" in f["error"] for f in failures)
    assert watcher.statuses("broken") == ["loading", "unloaded", "loading", "unloaded"]


def test_an_engine_that_dies_fails_its_requests_and_comes_back(client: openai.OpenAI, router: Server) -> None:
    client.chat.completions.create(model="qwen3-tiny", messages=HI, max_tokens=1)
    pid = router.load()["qwen3-tiny"]["pid"]
    stream = client.chat.completions.create(model="qwen3-tiny", messages=HI, max_tokens=1500,
                                            extra_body={"ignore_eos": True}, stream=True)
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as caught:
        for _ in chunks:
            pass
    assert "engine" in str(caught.value)
    wait_until(lambda: router.load()["qwen3-tiny"]["state"] == "unloaded", 10, "the failure to be noticed")
    card = next(m for m in router.get("/v1/models").json()["data"] if m["id"] == "qwen3-tiny")
    assert card["status"]["failed"] is True

    reply = client.chat.completions.create(model="qwen3-tiny", messages=HI, max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert router.load()["qwen3-tiny"]["pid"] != pid


def test_closing_a_watcher_does_not_wait_for_the_next_keep_alive(router: Server) -> None:
    # tests/support/sse.py: the stream is quiet for 5 s between keep-alives;
    # close() used to wait that long for its reader's read to return.
    watcher = SseWatcher(router.url + "/models/sse")
    started = time.monotonic()
    watcher.close()
    assert time.monotonic() - started < 2
