"""Big /tokenize and /detokenize requests: bounded, answered right, and run
off the event loop, so /health keeps answering quickly while they work."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from router.llamacpp.tokens import MAX_DETOKENIZE_TOKENS, MAX_TOKENIZE_CHARS
from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow

MODEL = "words"
LINE = "Roundhouse tokenizes this sentence again; 12345 — ünïcode 🙂 and <b>tags</b>.\n"


def text_of(chars: int) -> str:
    return (LINE * (chars // len(LINE) + 1))[:chars]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    models = tmp_path_factory.mktemp("off-loop") / "models"
    models.mkdir()
    scripted_model(models / MODEL, tiny_qwen3_dir, QWEN3_SCRIPT)
    log = tmp_path_factory.mktemp("off-loop-log") / "router.log"
    with running_server(["--models-dir", str(models)], log, env=ENGINE_ENV) as running:
        # The model's text side loads on first use; that is not what is measured.
        assert running.post("/tokenize", json={"content": "hi", "with_pieces": True}).ok
        yield running


# Runs in its own process, so that reading the answers does not take the
# GIL from the thread that times /health.
LOADER = """
import sys, threading, requests
url, chars, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
line = {line!r}
text = (line * (chars // len(line) + 1))[:chars]
failures = []
def load():
    with requests.post(url + "/tokenize", json={{"content": text, "with_pieces": True}},
                       timeout=300, stream=True) as reply:
        size = sum(len(chunk) for chunk in reply.iter_content(1 << 20))
        if reply.status_code != 200 or size < chars:
            failures.append((reply.status_code, size))
threads = [threading.Thread(target=load) for _ in range(count)]
[t.start() for t in threads]
[t.join() for t in threads]
sys.exit(1 if failures else 0)
"""


def test_health_answers_quickly_while_big_tokenize_requests_run(server: Server) -> None:
    loader = subprocess.Popen([sys.executable, "-c", LOADER.format(line=LINE), server.url,
                               str(MAX_TOKENIZE_CHARS * 3 // 4), "4"])
    probe = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    latencies: list[float] = []
    try:
        while loader.poll() is None:
            started = time.perf_counter()
            probe.request("GET", "/health")
            reply = probe.getresponse()
            reply.read()
            latencies.append(time.perf_counter() - started)
            assert reply.status == 200
            time.sleep(0.01)
    finally:
        probe.close()
        loader.wait(timeout=300)
    assert loader.returncode == 0
    assert len(latencies) >= 10
    latencies.sort()
    worst, p95 = latencies[-1], latencies[int(len(latencies) * 0.95)]
    # 50 ms is the goal for every probe; a shared CI machine may deschedule
    # the server now and then, so one probe in twenty may miss it, and none
    # by much. Before, each of these requests stalled /health for seconds.
    assert p95 < 0.050 and worst < 0.200, (
        f"{len(latencies)} probes: p95 {p95 * 1000:.0f} ms, worst {worst * 1000:.0f} ms")


def test_long_answers_match_short_ones(server: Server) -> None:
    text = text_of(200_000)
    ids = server.post("/tokenize", json={"content": text}).json()["tokens"]
    pieces = server.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] for p in pieces) == text  # every piece of this text is whole UTF-8
    first = server.post("/tokenize", json={"content": LINE, "with_pieces": True}).json()["tokens"]
    assert pieces[:len(first)] == first
    assert server.post("/detokenize", json={"tokens": ids}).json() == {"content": text}


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/tokenize", {"content": "y" * (MAX_TOKENIZE_CHARS + 1)}, "content"),
    ("/detokenize", {"tokens": [1] * (MAX_DETOKENIZE_TOKENS + 1)}, "tokens"),
    ("/detokenize", {"tokens": [5, 151_669]}, "tokens"),
])
def test_past_the_bounds_is_a_400_naming_the_field(server: Server, path: str, body: dict,
                                                   field: str) -> None:
    reply = server.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == 400 and f"'{field}'" in error["message"]


def test_the_bounds_themselves_are_served(server: Server) -> None:
    reply = server.post("/tokenize", json={"content": "y" * MAX_TOKENIZE_CHARS})
    assert reply.status_code == 200 and reply.json()["tokens"]
