"""API keys: parsing and labels, the key file's permissions and rotation, the
constant-time check, and the middleware's answers in each route's shape."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.config import ServeConfig
from router.http import auth
from router.http.auth import (
    AuthConfigError,
    KeyStore,
    auth_middleware,
    labelled,
    parse_key_file,
)
from router.http.errors import error_middleware
from router.http.route_info import Access, Api, Route
from router.http.routes import add_routes
from router.observability.records import RequestRecord, current_record

KEY_FILE = """\
# rotated 2025-01-01
alice: sk-alice-0001
sk-unlabelled-02   # the CI runner

bob:sk-bob:with-colon
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_keys(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def rewrite(path: Path, text: str) -> None:
    """Change the file so that its stamp surely changes (size, mtime)."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


def config(**fields: Any) -> ServeConfig:
    return ServeConfig(model=Path("model.gguf"), **fields)


# ---- sources and labels -----------------------------------------------------


def test_labels_of_every_source(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys", KEY_FILE)
    store = KeyStore.from_config(config(api_keys=("sk-c1", "sk-c2"), api_keys_env=("sk-e1",),
                                        api_key_file=keys))
    assert store.enabled
    assert store.labels == ("cli-1", "cli-2", "env-1", "file-alice", "file-2", "file-bob")
    assert store.authenticate("sk-c2") == "cli-2"
    assert store.authenticate("sk-e1") == "env-1"
    assert store.authenticate("sk-alice-0001") == "file-alice"
    # n is the key's position among the file's keys, labelled ones counted.
    assert store.authenticate("sk-unlabelled-02") == "file-2"
    # Only the first ':' separates the label: a key may hold one.
    assert store.authenticate("sk-bob:with-colon") == "file-bob"
    assert store.authenticate("sk-nobody") is None
    assert store.authenticate("") is None


def test_no_keys_means_open() -> None:
    store = KeyStore.from_config(config())
    assert not store.enabled and store.labels == ()


def test_the_store_keeps_digests_never_keys(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys", KEY_FILE)
    store = KeyStore.from_config(config(api_keys=("sk-secret-cli",), api_key_file=keys))
    kept = repr(vars(store)) + repr(store.labels)
    for key in ("sk-secret-cli", "sk-alice-0001", "sk-unlabelled-02"):
        assert key not in kept


def test_key_file_syntax() -> None:
    text = "\ufeff# comment\r\n\r\n  alice :  sk-a#not-a-comment  # a comment\r\nsk-b\r\n"
    entries = parse_key_file(text)
    assert [entry.label for entry in entries] == ["file-alice", "file-2"]
    assert entries[0].digest == auth.digest("sk-a#not-a-comment")


@pytest.mark.parametrize(("text", "reason"), [
    ("", "holds no keys"),
    ("# only a comment\n\n", "holds no keys"),
    ("sk-a\nsk-b sk-c\n", "line 2: a key must be printable ASCII without spaces"),
    ("alice:\n", "line 1: the key is empty"),
    ("al ice: sk-a\n", "line 1: a label is"),
    ("a: sk-a\na: sk-b\n", "line 2: the label 'a' is used twice"),
    ("2: sk-a\nsk-b\n", "line 2: the label '2' is used twice"),
    ("a: sk-same\n\nb: sk-same\n", "line 3: the same key as line 1"),
    ("a: sk-\u00e9\n", "line 1: a key must be printable ASCII"),
])
def test_malformed_key_files(text: str, reason: str) -> None:
    with pytest.raises(AuthConfigError, match=reason) as caught:
        parse_key_file(text)
    assert "sk-" not in str(caught.value)


def test_bad_command_line_keys_are_refused() -> None:
    with pytest.raises(AuthConfigError, match="--api-key key 2: the key is empty"):
        labelled(["sk-a", ""], "cli", "--api-key")
    with pytest.raises(AuthConfigError, match="ROUNDHOUSE_API_KEY key 1: a key must be"):
        KeyStore.from_config(config(api_keys_env=("sk a",)))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_key_file_others_can_read_or_write_refuses_startup(tmp_path: Path, mode: int) -> None:
    keys = write_keys(tmp_path / "keys", "alice: sk-alice\n", mode)
    with pytest.raises(AuthConfigError, match=f"readable or writable by group or others "
                                              f"\\(mode {mode:03o}\\); chmod 600") as caught:
        KeyStore.from_config(config(api_key_file=keys))
    assert str(keys) in str(caught.value) and "sk-alice" not in str(caught.value)


def test_a_key_file_owned_by_another_user_refuses_startup_and_closes_on_reload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As OpenSSH asks of authorized_keys: the server's user or root owns it."""
    keys = write_keys(tmp_path / "keys", "alice: sk-alice\n")
    other = 65534 if os.geteuid() != 65534 else 65533
    if os.geteuid() == 0:
        os.chown(keys, other, -1)
    else:
        # Not root: the file is ours; pretend to be someone else instead.
        monkeypatch.setattr(auth.os, "geteuid", lambda: other)
        other = os.getuid()
    with pytest.raises(AuthConfigError, match=f"owned by uid {other}, neither the user the "
                                              "server runs as .* nor root; chown it") as caught:
        KeyStore.from_config(config(api_key_file=keys))
    assert "sk-alice" not in str(caught.value)
    monkeypatch.undo()
    if os.geteuid() == 0:
        os.chown(keys, 0, -1)
        store = KeyStore.from_config(config(api_key_file=keys))
        assert store.authenticate("sk-alice") == "file-alice"
        os.chown(keys, other, -1)
        store.reload()
        assert store.closed and store.authenticate("sk-alice") is None


def test_a_missing_or_invalid_key_file_refuses_startup(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="cannot open it"):
        KeyStore.from_config(config(api_key_file=tmp_path / "absent"))
    with pytest.raises(AuthConfigError, match="holds no keys"):
        KeyStore.from_config(config(api_key_file=write_keys(tmp_path / "empty", "\n")))
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(AuthConfigError, match="not a regular file"):
        KeyStore.from_config(config(api_key_file=tmp_path / "dir"))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    binary.chmod(0o600)
    with pytest.raises(AuthConfigError, match="not UTF-8"):
        KeyStore.from_config(config(api_key_file=binary))


# ---- the constant-time check ------------------------------------------------------


def test_every_digest_is_compared_whatever_matches(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    keys = write_keys(tmp_path / "keys", KEY_FILE)
    store = KeyStore.from_config(config(api_keys=("sk-c1", "sk-c2"), api_keys_env=("sk-e1",),
                                        api_key_file=keys))
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for key, label in [("sk-c1", "cli-1"), ("sk-bob:with-colon", "file-bob"), ("sk-no", None)]:
        compared.clear()
        assert store.authenticate(key) == label
        # One comparison per configured digest, first match or none, always
        # with digests (equal lengths), never with the key itself.
        assert len(compared) == 6
        assert {a for a, _ in compared} == {entry.digest for entry in store._entries()}
        assert {b for _, b in compared} == {auth.digest(key)}


# ---- rotation -------------------------------------------------------------------


@pytest.fixture
def rotating(tmp_path: Path) -> tuple[KeyStore, Path, Clock]:
    clock = Clock()
    keys = write_keys(tmp_path / "keys", "alice: sk-alice\n")
    store = KeyStore([*labelled(["sk-cli"], "cli", "--api-key")], keys, clock=clock)
    return store, keys, clock


def test_the_file_is_reread_when_it_changes_at_most_once_a_second(
        rotating: tuple[KeyStore, Path, Clock], monkeypatch: pytest.MonkeyPatch) -> None:
    store, keys, clock = rotating
    stats: list[Path] = []
    real_stamp = auth.current_stamp
    monkeypatch.setattr(auth, "current_stamp", lambda path: stats.append(path) or real_stamp(path))
    rewrite(keys, "bob: sk-bob\n")
    store.refresh()  # less than a second after the load: no look at the file
    assert stats == [] and store.authenticate("sk-alice") == "file-alice"
    clock.now += 1.0
    store.refresh()
    assert len(stats) == 1
    assert store.authenticate("sk-bob") == "file-bob" and store.authenticate("sk-alice") is None
    for _ in range(5):
        store.refresh()
    assert len(stats) == 1


def test_a_malformed_replacement_closes_everything_until_a_valid_one_returns(
        rotating: tuple[KeyStore, Path, Clock], caplog: pytest.LogCaptureFixture) -> None:
    store, keys, clock = rotating
    caplog.set_level(logging.INFO, logger="router.http.auth")
    rewrite(keys, "alice: sk-alice extra words\n")
    clock.now += 1.0
    store.refresh()
    assert store.closed
    # Every key fails, those of the command line and the old file's included.
    assert store.authenticate("sk-alice") is None and store.authenticate("sk-cli") is None
    closing = caplog.records[-1]
    assert closing.levelno == logging.ERROR and "closed until a valid file returns" in closing.message
    assert "line 1" in closing.message and "sk-alice" not in closing.message

    rewrite(keys, "")  # still invalid: logged again, still closed
    clock.now += 1.0
    store.refresh()
    assert store.closed and "still closed" in caplog.records[-1].message

    rewrite(keys, "alice: sk-alice\ncarol: sk-carol\n")
    clock.now += 1.0
    store.refresh()
    assert not store.closed
    reopening = caplog.records[-1]
    assert reopening.levelno == logging.INFO and "valid again (2 keys)" in reopening.message
    assert store.authenticate("sk-carol") == "file-carol" and store.authenticate("sk-cli") == "cli-1"


def test_removed_or_exposed_files_close_and_chmod_reopens(
        rotating: tuple[KeyStore, Path, Clock]) -> None:
    store, keys, clock = rotating
    keys.chmod(0o644)  # only the ctime changes
    clock.now += 1.0
    store.refresh()
    assert store.closed and store.authenticate("sk-alice") is None
    keys.chmod(0o600)
    clock.now += 1.0
    store.refresh()
    assert store.authenticate("sk-alice") == "file-alice"

    text = keys.read_text()
    keys.unlink()
    clock.now += 1.0
    store.refresh()
    assert store.closed
    write_keys(keys, text)
    clock.now += 1.0
    store.refresh()
    assert store.authenticate("sk-alice") == "file-alice"


def test_reload_reads_at_once_and_an_unchanged_file_is_not_reread(
        rotating: tuple[KeyStore, Path, Clock], monkeypatch: pytest.MonkeyPatch) -> None:
    store, keys, clock = rotating
    reads: list[Path] = []
    real_read = auth.read_key_file
    monkeypatch.setattr(auth, "read_key_file", lambda path: reads.append(path) or real_read(path))
    clock.now += 5.0
    store.refresh()
    assert reads == []
    rewrite(keys, "dave: sk-dave\n")
    store.reload()  # SIGHUP: no waiting for the clock
    assert reads == [keys] and store.authenticate("sk-dave") == "file-dave"


# ---- the middleware -------------------------------------------------------------


async def _ok(request: web.Request) -> web.Response:
    record = current_record.get()
    return web.json_response({"key_label": record.key_label if record else None})


@web.middleware
async def _with_record(request: web.Request, handler: Any) -> web.StreamResponse:
    """What the observe middleware does for the record."""
    token = current_record.set(RequestRecord(method=request.method, route=request.path))
    try:
        return await handler(request)
    finally:
        current_record.reset(token)


def app_with(store: KeyStore, *, metrics_open: bool = False) -> web.Application:
    app = web.Application(middlewares=[_with_record, error_middleware,
                                       auth_middleware(store, metrics_open=metrics_open)])
    add_routes(app, [
        Route("POST", "/v1/chat/completions", _ok, Api.OPENAI),
        Route("POST", "/v1/messages", _ok, Api.ANTHROPIC),
        Route("POST", "/completion", _ok, Api.LLAMACPP),
        Route("GET", "/health", _ok, Api.LLAMACPP, Access.OPEN),
        Route("GET", "/v1/health", _ok, Api.OPENAI, Access.OPEN),
        Route("GET", "/metrics", _ok, Api.LLAMACPP, Access.METRICS),
        Route("GET", "/models", _ok, Api.LLAMACPP),
    ])
    return app


Answer = tuple[int, dict[str, str], dict[str, Any]]


def calls(app: web.Application, requests: list[tuple[str, str, dict[str, str]]]) -> list[Answer]:
    """(status, headers, JSON body) of each request, in order."""

    async def run() -> list[Answer]:
        async with TestClient(TestServer(app)) as client:
            answers = []
            for method, path, headers in requests:
                response = await client.request(method, path, headers=headers)
                answers.append((response.status, dict(response.headers), await response.json()))
            return answers

    return asyncio.run(run())


def test_either_header_style_and_the_label_reaches_the_record() -> None:
    store = KeyStore(labelled(["sk-one", "sk-two"], "cli", "--api-key"))
    answers = calls(app_with(store), [
        ("POST", "/v1/chat/completions", {"Authorization": "Bearer sk-one"}),
        ("POST", "/v1/chat/completions", {"Authorization": "bearer sk-two"}),
        ("POST", "/v1/messages", {"x-api-key": "sk-two"}),
        # A stale Bearer token from a proxy does not hide a good x-api-key.
        ("POST", "/v1/messages", {"Authorization": "Bearer sk-old", "x-api-key": "sk-one"}),
    ])
    assert [(status, body) for status, _, body in answers] == [
        (200, {"key_label": "cli-1"}), (200, {"key_label": "cli-2"}),
        (200, {"key_label": "cli-2"}), (200, {"key_label": "cli-1"})]


def test_401s_in_each_routes_shape() -> None:
    store = KeyStore(labelled(["sk-one"], "cli", "--api-key"))
    answers = calls(app_with(store), [
        ("POST", "/v1/chat/completions", {}),
        ("POST", "/v1/chat/completions", {"Authorization": "Bearer sk-wrong"}),
        ("POST", "/v1/messages", {"x-api-key": "sk-wrong"}),
        ("POST", "/completion", {"Authorization": "Basic c2stb25lOg=="}),
        ("GET", "/models", {"x-api-key": "sk-wrong"}),
    ])
    for status, headers, _ in answers:
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    (_, _, missing), (_, _, wrong), (_, headers, anthropic), (_, _, llama), (_, _, models) = answers
    assert missing == {"error": {"message": missing["error"]["message"], "type":
                                 "authentication_error", "param": None, "code": "missing_api_key"}}
    assert "x-api-key" in missing["error"]["message"]
    assert wrong["error"]["code"] == "invalid_api_key"
    assert wrong["error"]["type"] == "authentication_error"
    assert anthropic["type"] == "error" and anthropic["error"]["type"] == "authentication_error"
    assert headers["request-id"] == anthropic["request_id"]
    assert llama["error"] == {"code": 401, "message": llama["error"]["message"],
                              "type": "authentication_error", "reason": "missing_api_key"}
    assert models["error"]["reason"] == "invalid_api_key"
    assert all("sk-" not in str(body) for _, _, body in answers)


def test_what_stays_open() -> None:
    store = KeyStore(labelled(["sk-one"], "cli", "--api-key"))
    closed = calls(app_with(store), [("GET", "/health", {}), ("GET", "/v1/health", {}),
                                     ("GET", "/metrics", {}), ("GET", "/models", {})])
    assert [status for status, _, _ in closed] == [200, 200, 401, 401]
    metrics_open = calls(app_with(store, metrics_open=True), [("GET", "/metrics", {})])
    assert metrics_open[0][0] == 200
    # Without any key configured, everything is open.
    everything = calls(app_with(KeyStore([])), [("POST", "/v1/chat/completions", {}),
                                                ("GET", "/metrics", {})])
    assert [status for status, _, _ in everything] == [200, 200]
    assert everything[0][2] == {"key_label": None}


def test_a_closed_key_file_refuses_every_key_through_the_middleware(tmp_path: Path) -> None:
    clock = Clock()
    keys = write_keys(tmp_path / "keys", "alice: sk-alice\n")
    store = KeyStore(labelled(["sk-cli"], "cli", "--api-key"), keys, clock=clock)
    rewrite(keys, "not a key file\n")
    clock.now += 1.0
    answers = calls(app_with(store), [
        ("POST", "/v1/chat/completions", {"Authorization": "Bearer sk-alice"}),
        ("POST", "/v1/chat/completions", {"Authorization": "Bearer sk-cli"}),
        ("GET", "/health", {}),
    ])
    assert [status for status, _, _ in answers] == [401, 401, 200]
    assert answers[0][2]["error"]["code"] == "invalid_api_key"
