"""The HTTP server against slow and hostile clients, on real sockets (scripted
engine): header, body and keep-alive deadlines, the connection bound, the
Host check against DNS rebinding, OPTIONS that tells nothing, CORS by origin,
and the x-request-id every response carries."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
import requests

from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import Server, running_server, wait_until

pytestmark = pytest.mark.slow

MODEL = "qwen3-scripted"
KEY = "sk-hardening-41c7"
AUTH = {"Authorization": f"Bearer {KEY}"}
SAY_HELLO = [{"role": "user", "content": "Say hello"}]
# Short deadlines, so that each test sees them bite in well under a second.
TIMEOUT_MS = 500
MAX_CONNECTIONS = 8
APP_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("hardening-models")
    scripted_model(directory / MODEL, tiny_qwen3_dir, QWEN3_SCRIPT)
    return directory


@pytest.fixture(scope="module")
def quick(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No keys, no CORS, short deadlines."""
    logs = tmp_path_factory.mktemp("quick-logs")
    args = ["--models-dir", str(models), "--http-header-timeout-ms", str(TIMEOUT_MS),
            "--http-body-timeout-ms", str(TIMEOUT_MS),
            "--http-keepalive-timeout-ms", str(TIMEOUT_MS)]
    with running_server(args, logs / "router.log", env=ENGINE_ENV) as server:
        yield server


@pytest.fixture(scope="module")
def guarded(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A key, a connection bound, an allowed host, CORS for one origin, a request log."""
    logs = tmp_path_factory.mktemp("guarded-logs")
    args = ["--models-dir", str(models), "--api-key", KEY,
            "--max-connections", str(MAX_CONNECTIONS), "--allowed-host", "rh.example",
            "--cors-origins", APP_ORIGIN, "--request-log-jsonl", str(logs / "requests.jsonl")]
    with running_server(args, logs / "router.log", env=ENGINE_ENV) as server:
        yield server


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took.
    A server that never closes fails the test with socket.timeout."""
    started = time.monotonic()
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks), time.monotonic() - started


# ---- deadlines ---------------------------------------------------------------------


def test_half_a_header_line_is_answered_408_and_closed(quick: Server) -> None:
    with connect(quick) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: loc")
        data, seconds = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert TIMEOUT_MS / 1000 * 0.8 < seconds < 5
    wait_until(lambda: "no complete request headers within 0.5 s (--http-header-timeout-ms)"
               in quick.log(), 5, "the header timeout's log line", quick)


def test_a_connection_that_sends_nothing_is_closed(quick: Server) -> None:
    with connect(quick) as sock:
        data, seconds = read_until_closed(sock)
    assert data == b"" and seconds < 5


def test_half_a_body_is_answered_408_and_closed(quick: Server) -> None:
    with connect(quick) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"content": "Say')
        data, seconds = read_until_closed(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"]["reason"] == "request_body_timeout"
    assert seconds < 5
    wait_until(lambda: "the request body was not in within 0.5 s (--http-body-timeout-ms)"
               in quick.log(), 5, "the body timeout's log line", quick)


def test_an_idle_keep_alive_connection_is_closed(quick: Server) -> None:
    with connect(quick) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        data, seconds = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.count(b"HTTP/1.1") == 1
    assert seconds < 5


def test_requests_and_a_stream_longer_than_every_deadline_still_work(quick: Server) -> None:
    with requests.Session() as session:
        started = time.monotonic()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story"}],
                "max_tokens": 400, "stream": True}
        with session.post(quick.url + "/v1/chat/completions", json=body, stream=True,
                          timeout=60) as streamed:
            assert streamed.status_code == 200
            content = streamed.content
        # The stream outlived every deadline many times over, and ran to its end.
        assert time.monotonic() - started > 3 * TIMEOUT_MS / 1000
        assert content.rstrip().endswith(b"data: [DONE]")
        assert b'"finish_reason":"length"' in content
        # The same connection serves the next request.
        assert session.post(quick.url + "/tokenize", json={"content": "hi"},
                            timeout=30).status_code == 200


def test_options_without_cors_says_the_same_for_every_path(quick: Server) -> None:
    """405 whether the route exists or not: OPTIONS does not map the server."""
    answers = []
    for path in ("/v1/chat/completions", "/no/such/route", "/health"):
        for extra in ({}, {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST"}):
            response = requests.options(quick.url + path, headers=extra, timeout=30)
            assert not any(name.lower().startswith("access-control-") for name in response.headers)
            error = response.json()["error"]  # llama.cpp's shape names the code `reason`
            answers.append((response.status_code, error.get("reason", error["code"])))
    assert set(answers) == {(405, "method_not_allowed")}


# ---- the connection bound -------------------------------------------------------------


def health_on(sock: socket.socket) -> bytes:
    """Ask for /health; what came back (b"" when the server closed or reset)."""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        return sock.recv(65536)
    except (ConnectionResetError, BrokenPipeError):
        return b""


def test_connections_over_the_bound_are_refused_at_once(guarded: Server) -> None:
    held: list[socket.socket] = []
    try:
        refused: bytes | None = None
        for _ in range(MAX_CONNECTIONS + 1):
            sock = connect(guarded)
            held.append(sock)
            answer = health_on(sock)
            if not answer.startswith(b"HTTP/1.1 200"):
                refused = answer
                break
        # Connections other tests left open may count too: at most the bound were served.
        assert refused is not None, "every connection was served"
        # The 503 is lost when the reset that follows the close outruns it.
        assert refused == b"" or refused.startswith(b"HTTP/1.1 503 Service Unavailable")
        wait_until(lambda: "refused a connection from 127.0.0.1:" in guarded.log()
                   and "connections are open (--max-connections)" in guarded.log(), 5,
                   "the refusal's log line", guarded)
    finally:
        for sock in held:
            sock.close()
    # Room again once they are gone.
    wait_until(lambda: health_status(guarded) == 200, 10, "a connection to be served", guarded)


def health_status(server: Server) -> int:
    try:
        return requests.get(server.url + "/health", timeout=5).status_code
    except requests.RequestException:
        return 0


# ---- Host check (DNS rebinding) --------------------------------------------------------


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "LOCALHOST.", "ui.localhost:3",
                                  "127.0.0.1", "127.8.9.10:80", "[::1]:8080", "[::1]",
                                  "rh.example", "RH.example:443"])
def test_loopback_and_allowed_hosts_pass(guarded: Server, host: str) -> None:
    response = requests.get(guarded.url + "/v1/models", headers={**AUTH, "Host": host}, timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("path", "shape"), [("/v1/models", "openai"), ("/health", "llamacpp"),
                                             ("/v1/messages", "anthropic")])
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "192.168.1.5", "[::2]"])
def test_other_hosts_get_403_even_with_a_key(guarded: Server, host: str, path: str,
                                             shape: str) -> None:
    method = requests.post if path == "/v1/messages" else requests.get
    response = method(guarded.url + path, headers={**AUTH, "Host": host}, timeout=30)
    assert response.status_code == 403, response.text
    body = response.json()
    if shape == "openai":
        assert body["error"]["code"] == "host_not_allowed"
    elif shape == "llamacpp":
        assert body["error"]["reason"] == "host_not_allowed"
    else:
        assert body["error"]["type"] == "permission_error"
    assert "--allowed-host" in response.text


# ---- what stays open, CORS by origin -------------------------------------------------------


def test_head_health_is_open_like_get(guarded: Server) -> None:
    assert requests.head(guarded.url + "/health", timeout=30).status_code == 200
    assert requests.head(guarded.url + "/v1/models", timeout=30).status_code == 401
    assert requests.head(guarded.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_cors_answers_listed_origins_only(guarded: Server) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    for path in ("/v1/chat/completions", "/no/such/route"):
        allowed = requests.options(guarded.url + path, timeout=30,
                                   headers={**preflight, "Origin": APP_ORIGIN})
        # As llama.cpp answers: 200, an empty body, the origin echoed.
        assert allowed.status_code == 200 and allowed.content == b""
        assert allowed.headers["Access-Control-Allow-Origin"] == APP_ORIGIN
        assert allowed.headers["Access-Control-Allow-Credentials"] == "true"
        assert allowed.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert "POST" in allowed.headers["Access-Control-Allow-Methods"]
        other = requests.options(guarded.url + path, timeout=30,
                                 headers={**preflight, "Origin": "https://evil.example"})
        assert other.status_code == 403
        assert "Access-Control-Allow-Origin" not in other.headers
    listed = requests.get(guarded.url + "/v1/models", headers={**AUTH, "Origin": APP_ORIGIN},
                          timeout=30)
    assert listed.headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert "X-Request-Id" in listed.headers["Access-Control-Expose-Headers"]
    unlisted = requests.get(guarded.url + "/v1/models", timeout=30,
                            headers={**AUTH, "Origin": "https://evil.example"})
    assert unlisted.status_code == 200 and "Access-Control-Allow-Origin" not in unlisted.headers
    assert "Origin" in unlisted.headers["Vary"]


# ---- x-request-id ------------------------------------------------------------------------


def test_every_response_carries_an_x_request_id(guarded: Server) -> None:
    # One connection (the bound is small).
    with requests.Session() as session:
        responses = [session.get(guarded.url + "/health", timeout=30),
                     session.get(guarded.url + "/v1/models", timeout=30),  # 401
                     session.get(guarded.url + "/nowhere", headers=AUTH, timeout=30),  # 404
                     session.get(guarded.url + "/metrics", headers=AUTH, timeout=30),
                     session.post(guarded.url + "/tokenize", json={"content": "hi"},
                                  headers=AUTH, timeout=30)]
    ids = [response.headers["x-request-id"] for response in responses]
    assert all(request_id.startswith("req-") for request_id in ids)
    assert len(set(ids)) == len(ids)


def test_a_clients_request_id_is_honoured_when_sane(guarded: Server) -> None:
    sent = {"X-Request-Id": "gateway-7f3a/1", **AUTH}
    with requests.Session() as session:
        assert session.get(guarded.url + "/v1/models", headers=sent,
                           timeout=30).headers["x-request-id"] == "gateway-7f3a/1"
        for bad in ("has space", "x" * 129, "caf\u00e9".encode().decode("latin-1")):
            answered = session.get(guarded.url + "/v1/models", timeout=30,
                                   headers={**AUTH, "X-Request-Id": bad}).headers["x-request-id"]
            assert answered.startswith("req-") and answered != bad


def test_the_sdks_read_the_request_id_and_the_log_keeps_it(guarded: Server) -> None:
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0) as client:
        reply = client.chat.completions.create(model=MODEL, messages=SAY_HELLO,  # type: ignore[arg-type]
                                               max_tokens=4)
        assert reply._request_id is not None and reply._request_id.startswith("req-")
        traced = client.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=SAY_HELLO, max_tokens=4,
            extra_headers={"X-Request-Id": "trace-0001"})
        assert traced._request_id == "trace-0001"
    with anthropic.Anthropic(base_url=guarded.url, api_key=KEY, max_retries=0) as claude:
        raw = claude.messages.with_raw_response.create(model=MODEL, max_tokens=4,
                                                       messages=SAY_HELLO)  # type: ignore[arg-type]
        assert raw.headers["request-id"] == raw.headers["x-request-id"]
    refused = requests.post(guarded.url + "/v1/messages", json={"model": MODEL}, timeout=30)
    assert refused.status_code == 401
    assert refused.json()["request_id"] == refused.headers["request-id"] \
        == refused.headers["x-request-id"]

    log_path = guarded.log_path.parent / "requests.jsonl"

    def events() -> list[dict]:  # type: ignore[type-arg]
        if not log_path.exists():
            return []
        return [json.loads(line) for line in log_path.read_text().splitlines()]

    def done(request_id: str) -> list[dict]:  # type: ignore[type-arg]
        return [e for e in events() if e["event"] == "request_done"
                and request_id in (e["request_id"], e["client_request_id"])]

    wait_until(lambda: done(reply._request_id) and done("trace-0001"), 10,  # type: ignore[arg-type]
               "the request log's events", guarded)
    mine = done(reply._request_id)[0]  # type: ignore[arg-type]
    assert mine["request_id"] == reply._request_id and mine["client_request_id"] is None
    theirs = done("trace-0001")[0]
    assert theirs["client_request_id"] == "trace-0001" and theirs["request_id"].startswith("req-")
