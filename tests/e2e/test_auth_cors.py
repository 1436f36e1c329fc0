"""API keys and CORS against a real server (scripted engine): every route
family asks for a key in its own error shape, /health stays open, the key
file rotates (by its mtime and by SIGHUP) and fails closed, a key file others
can read refuses startup, an open bind without keys warns, and the SDKs
authenticate with their api_key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import requests

from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import Server, free_port, running_server, wait_until

pytestmark = pytest.mark.slow

MODEL = "qwen3-scripted"
CLI_KEY = "sk-cli-7f3a9c"
ENV_KEY = "sk-env-51d2e0"
FILE_KEY = "sk-file-alice-8b4c"
UNLABELLED_KEY = "sk-file-ci-02aa"
ALL_KEYS = (CLI_KEY, ENV_KEY, FILE_KEY, UNLABELLED_KEY)
SAY_HELLO = [{"role": "user", "content": "Say hello"}]
ORIGIN = "https://chat.example.com"

# Every route family, with a body that succeeds given a good key.
ROUTES: list[tuple[str, str, dict[str, Any] | None, str]] = [
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": SAY_HELLO, "max_tokens": 4},
     "openai"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Say hello", "max_tokens": 4}, "openai"),
    ("POST", "/v1/responses", {"model": MODEL, "input": "Say hello", "max_output_tokens": 4},
     "openai"),
    ("GET", "/v1/models", None, "openai"),
    ("POST", "/v1/messages", {"model": MODEL, "messages": SAY_HELLO, "max_tokens": 4},
     "anthropic"),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": SAY_HELLO}, "anthropic"),
    ("POST", "/completion", {"model": MODEL, "prompt": "Say hello", "n_predict": 4}, "llamacpp"),
    ("POST", "/tokenize", {"model": MODEL, "content": "Say hello"}, "llamacpp"),
    ("GET", "/props", None, "llamacpp"),
    ("GET", "/models", None, "llamacpp"),
    ("POST", "/models/load", {"model": MODEL}, "llamacpp"),
]
ROUTE_IDS = [f"{method} {path}" for method, path, _, _ in ROUTES]


def key_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def rewrite(path: Path, text: str) -> None:
    """Replace the file as a careful operator does: a new file renamed over it."""
    fresh = path.with_suffix(".new")
    key_file(fresh, text)
    fresh.rename(path)


def call(server: Server, method: str, path: str, body: dict[str, Any] | None,
         headers: dict[str, str]) -> requests.Response:
    return requests.request(method, server.url + path, json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("auth-models")
    scripted_model(directory / MODEL, tiny_qwen3_dir, QWEN3_SCRIPT)
    return directory


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("auth-logs")
    keys = key_file(logs / "keys", f"# who may call\nalice: {FILE_KEY}\n{UNLABELLED_KEY}\n")
    args = ["--models-dir", str(models), "--models-max", "0", "--api-key", CLI_KEY,
            "--api-key-file", str(keys), "--cors"]
    with running_server(args, logs / "router.log",
                        env={**ENGINE_ENV, "ROUNDHOUSE_API_KEY": ENV_KEY}) as running:
        yield running
    # Whatever happened, no key reached the log.
    assert not any(key in running.log() for key in ALL_KEYS)


# ---- the auth matrix --------------------------------------------------------------


def assert_401(response: requests.Response, shape: str, code: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"] == "Bearer"
    body = response.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert body["request_id"] == response.headers["request-id"]
    elif shape == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == code
    else:
        assert body["error"]["code"] == 401 and body["error"]["reason"] == code
        assert body["error"]["type"] == "authentication_error"
    assert not any(key in response.text for key in ALL_KEYS)


@pytest.mark.parametrize(("method", "path", "body", "shape"), ROUTES, ids=ROUTE_IDS)
def test_missing_and_wrong_keys_get_401_in_the_routes_shape(
        server: Server, method: str, path: str, body: dict[str, Any] | None, shape: str) -> None:
    assert_401(call(server, method, path, body, {}), shape, "missing_api_key")
    assert_401(call(server, method, path, body, {"Authorization": "Basic YWxpY2U6"}), shape,
               "missing_api_key")
    assert_401(call(server, method, path, body, {"Authorization": "Bearer sk-wrong"}), shape,
               "invalid_api_key")
    assert_401(call(server, method, path, body, {"x-api-key": "sk-wrong"}), shape,
               "invalid_api_key")
    # A key differing only in its last character is just as wrong.
    assert_401(call(server, method, path, body, {"x-api-key": CLI_KEY[:-1] + "d"}), shape,
               "invalid_api_key")


@pytest.mark.parametrize(("method", "path", "body", "shape"), ROUTES, ids=ROUTE_IDS)
def test_every_source_and_header_style_is_let_in(
        server: Server, method: str, path: str, body: dict[str, Any] | None, shape: str) -> None:
    for headers in ({"Authorization": f"Bearer {CLI_KEY}"}, {"x-api-key": ENV_KEY},
                    {"Authorization": f"Bearer {FILE_KEY}"}, {"x-api-key": UNLABELLED_KEY}):
        response = call(server, method, path, body, headers)
        assert response.status_code == 200, (headers, response.text)


def test_health_is_open_and_says_only_ok(server: Server) -> None:
    for path in ("/health", "/v1/health"):
        response = server.get(path)
        assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_metrics_need_a_key_without_metrics_open(server: Server) -> None:
    assert_401(server.get("/metrics"), "llamacpp", "missing_api_key")


def test_metrics_count_requests_by_key_label_never_by_key(server: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    call(server, "POST", "/tokenize", {"content": "hi"}, {"x-api-key": CLI_KEY})
    text = server.get("/metrics", headers={"x-api-key": CLI_KEY}).text
    assert CLI_KEY not in text and FILE_KEY not in text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "roundhouse:requests_by_key_total"]
    assert any(s.labels == {"key": "cli-1", "outcome": "ok"} and s.value >= 1 for s in samples)


def test_unknown_routes_need_a_key_before_they_say_404(server: Server) -> None:
    assert_401(server.get("/v1/nothing-here"), "openai", "missing_api_key")
    response = server.get("/v1/nothing-here", headers={"x-api-key": CLI_KEY})
    assert response.status_code == 404


def test_startup_log_names_labels_only(server: Server) -> None:
    assert "API keys required (cli-1, env-1, file-alice, file-2)" in server.log()


# ---- the SDKs -----------------------------------------------------------------------


def test_the_openai_sdk_with_its_api_key(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=FILE_KEY, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=SAY_HELLO)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "Hello! How can I help you today?"
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_the_anthropic_sdk_with_its_api_key(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key=ENV_KEY, max_retries=0)
    message = client.messages.create(model=MODEL, max_tokens=64, messages=SAY_HELLO)  # type: ignore[arg-type]
    assert message.content[-1].text == "Hello! How can I help you today?"  # type: ignore[union-attr]
    assert client.messages.count_tokens(model=MODEL, messages=SAY_HELLO).input_tokens > 0  # type: ignore[arg-type]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=SAY_HELLO)  # type: ignore[arg-type]
    assert caught.value.status_code == 401


# ---- CORS -------------------------------------------------------------------------------


def test_a_preflight_answers_200_without_a_key(server: Server) -> None:
    response = requests.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    # As llama.cpp's server answers it: 200 and an empty body.
    assert response.status_code == 200 and response.content == b""
    assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
    # --cors is any origin: no credentials for pages anywhere.
    assert "Access-Control-Allow-Credentials" not in response.headers
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    assert response.headers["Access-Control-Allow-Headers"] == \
        "authorization, content-type, x-stainless-os"
    assert int(response.headers["Access-Control-Max-Age"]) > 0


def test_cors_headers_are_on_401s_and_streams(server: Server) -> None:
    refused = call(server, "POST", "/v1/messages", {"model": MODEL}, {"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "Request-Id" in refused.headers["Access-Control-Expose-Headers"]
    assert "Origin" in refused.headers["Vary"]
    body = {"model": MODEL, "messages": SAY_HELLO, "stream": True}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120,
                       headers={"Authorization": f"Bearer {CLI_KEY}"}) as streamed:
        assert streamed.status_code == 200
        # No Origin: any page may read it.
        assert streamed.headers["Access-Control-Allow-Origin"] == "*"
        assert b"data: [DONE]" in streamed.content


# ---- an open server: no keys, no CORS, a bind beyond loopback --------------------------


def test_without_keys_everything_is_open_and_an_open_bind_warns(
        models: Path, tmp_path: Path) -> None:
    args = ["--models-dir", str(models), "--host", "0.0.0.0"]
    with running_server(args, tmp_path / "router.log", env=ENGINE_ENV) as server:
        for method, path, body, _ in ROUTES:
            assert call(server, method, path, body, {}).status_code == 200, path
        preflight = requests.options(server.url + "/v1/chat/completions", timeout=30, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        models_list = server.get("/v1/models", headers={"Origin": ORIGIN})
        for response in (preflight, models_list):
            assert not any(name.lower().startswith("access-control-") for name in response.headers)
        assert "WARNING" in server.log() and "listening on 0.0.0.0 without API keys" in server.log()


def test_loopback_without_keys_does_not_warn(models: Path, tmp_path: Path) -> None:
    with running_server(["--models-dir", str(models)], tmp_path / "router.log",
                        env=ENGINE_ENV) as server:
        assert "without API keys" not in server.log()


def test_a_key_file_others_can_read_refuses_startup(models: Path, tmp_path: Path) -> None:
    keys = key_file(tmp_path / "keys", f"alice: {FILE_KEY}\n", mode=0o640)
    result = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--models-dir", str(models),
         "--port", str(free_port()), "--api-key-file", str(keys)],
        capture_output=True, text=True, timeout=120, env={**os.environ, **ENGINE_ENV})
    assert result.returncode == 1
    assert "readable or writable by group or others (mode 640); chmod 600 it" in result.stderr
    assert FILE_KEY not in result.stderr + result.stdout


# ---- rotation ---------------------------------------------------------------------------


def status_with(server: Server, key: str) -> int:
    return server.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


def test_key_file_rotation_by_mtime_and_by_sighup(models: Path, tmp_path: Path) -> None:
    keys = key_file(tmp_path / "keys", "alice: sk-alice-1\n")
    args = ["--models-dir", str(models), "--api-key", CLI_KEY, "--api-key-file", str(keys),
            "--metrics-open"]
    with running_server(args, tmp_path / "router.log", env=ENGINE_ENV) as server:
        assert status_with(server, "sk-alice-1") == 200
        # --metrics-open: a scrape needs no key; the rest still does.
        assert server.get("/metrics").status_code == 200
        assert server.get("/stats").status_code == 401

        # Seen by its mtime: a malformed file closes everything, the command
        # line's key and the key that was valid included.
        rewrite(keys, "alice: sk-alice-1 and some words\n")
        wait_until(lambda: status_with(server, "sk-alice-1") == 401, 10, "the key file to close",
                   server)
        assert status_with(server, CLI_KEY) == 401
        assert server.get("/health").json() == {"status": "ok"}
        assert "ERROR" in server.log() and "authenticated routes are closed" in server.log()
        rewrite(keys, "alice: sk-alice-2\n")
        wait_until(lambda: status_with(server, "sk-alice-2") == 200, 10, "the key file to open",
                   server)
        assert status_with(server, "sk-alice-1") == 401 and status_with(server, CLI_KEY) == 200
        assert "is valid again (1 key); authenticated routes are open" in server.log()

        # By SIGHUP: the change shows at once, before the once-a-second look
        # at the file could see it.
        for text, key, before, expected in [("", "sk-alice-2", 200, 401),
                                            ("bob: sk-bob-3\n", "sk-bob-3", 401, 200)]:
            # A second after the last look, so that this request makes the
            # server look (and not again for a second).
            time.sleep(1.1)
            started = time.monotonic()
            assert status_with(server, CLI_KEY) == before
            rewrite(keys, text)
            server.process.send_signal(signal.SIGHUP)
            wait_until(lambda key=key, expected=expected: status_with(server, key) == expected,
                       0.8 - (time.monotonic() - started), "SIGHUP to reload the key file", server)
            assert time.monotonic() - started < 1.0
        assert "holds no keys" in server.log()
