"""deploy/roundhouse.service and deploy/roundhouse.env, checked against systemd
and the real command line; router/systemd.py against a real notify socket; and
`roundhouse serve` against the sd_notify contract the unit relies on."""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from router.cli import CommandLineError, build_parser, parse_serve_command
from router.config import ServeConfig
from router.server import HANDLER_SHUTDOWN_SECONDS
from router.settings import ModelSettings
from router.systemd import monotonic_usec, notify
from tests.support.server import Server, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "roundhouse.service"
ENV_FILE = ROOT / "deploy" / "roundhouse.env"
# The console script of this environment: the unit's ExecStart, installed here.
ROUNDHOUSE = Path(sys.executable).parent / "roundhouse"

# ---------------------------------------------------------------------------
# A small reader for the two files: enough of systemd.syntax(7) and of
# systemd.exec(7)'s EnvironmentFile= and command-line rules for what we ship.

Unit = dict[str, list[tuple[str, str]]]


def parse_unit(text: str) -> Unit:
    """Sections to (key, value) pairs in file order; keys may repeat (After=,
    Environment=) and an empty value resets a list, so nothing is merged here."""
    unit: Unit = {}
    section: str | None = None
    pending = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            # A continuation joins the next line with a space (systemd.syntax(7)).
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"line {number}: bad section header {line!r}"
            section = line[1:-1]
            unit.setdefault(section, [])
            continue
        assert section is not None, f"line {number}: {line!r} before any [section]"
        key, sep, value = line.partition("=")
        assert sep, f"line {number}: {line!r} is not key=value"
        unit[section].append((key.strip(), value.strip()))
    return unit


def values(unit: Unit, section: str, key: str) -> list[str]:
    return [value for name, value in unit.get(section, []) if name == key]


def value(unit: Unit, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= is set {len(found)} times: {found}"
    return found[0]


def parse_env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd reads an EnvironmentFile=: '#' and ';' start
    comments, a value may be wholly single- or double-quoted (quotes removed),
    and values are taken literally ($ is not expanded)."""
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, val = line.partition("=")
        key, val = key.strip(), val.strip()
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), \
            f"line {number}: {raw!r} is not KEY=VALUE"
        quote = val[:1]
        if len(val) >= 2 and quote in ("'", '"') and val[-1] == quote:
            val = val[1:-1]
            if quote == '"':
                # Inside double quotes, a backslash escapes ", \, ` and $.
                val = re.sub(r'\\(["\\`$])', r"\1", val)
        env[key] = val
    return env


def unit_environment(unit: Unit, env_file_text: str) -> dict[str, str]:
    """What ExecStart= sees: Environment= assignments, then the EnvironmentFile=,
    which wins where both set a variable (systemd.exec(7))."""
    env: dict[str, str] = {}
    for assignments in values(unit, "Service", "Environment"):
        for word in shlex.split(assignments):
            name, _, val = word.partition("=")
            env[name] = val
    env.update(parse_env_file(env_file_text))
    return env


def expand_command(command: str, env: dict[str, str]) -> list[str]:
    """A command line as systemd runs it: split into words (quotes honored);
    a word that is exactly $NAME becomes the variable's words split at
    whitespace (none when unset); ${NAME} inside a word becomes its value as is."""
    argv: list[str] = []
    for word in shlex.split(command):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            argv.extend(shlex.split(env.get(whole.group(1), "")))
            continue
        # "$$" is a literal "$"; one pass, so a value's own "$" stays as it is.
        argv.append(re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}",
                           lambda m: env.get(m.group(1), "") if m.group(1) else "$", word))
    return argv


def serve_options() -> set[str]:
    """Every option string `roundhouse serve` accepts, from the CLI's own parser."""
    (commands,) = [action for action in build_parser()._actions
                   if isinstance(action, argparse._SubParsersAction)]
    return {flag for action in commands.choices["serve"]._actions for flag in action.option_strings}


def _no_default_model() -> Path:
    pytest.fail("this command line names no model: the service would fetch the default one")


def parse_serve(argv: list[str]) -> ServeConfig:
    """`roundhouse serve ...` (the words after the program) read exactly as the
    CLI reads them, without serving or downloading anything."""
    assert argv[:1] == ["serve"], argv
    try:
        return parse_serve_command(argv, default_model=_no_default_model)
    except CommandLineError as exc:
        pytest.fail(f"`roundhouse {shlex.join(argv)}` is refused: {exc}")


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(UNIT.read_text())


@pytest.fixture(scope="module")
def env_text() -> str:
    return ENV_FILE.read_text()


# ---------------------------------------------------------------------------
# The unit file, as systemd reads it.


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (CI images have no systemd)")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart='s program exists, so point it at this
    # environment's roundhouse, and run as a user that exists here; everything
    # else (directive names, values, sections) is checked as shipped.
    text = UNIT.read_text()
    text, starts = re.subn(r"(?m)^ExecStart=/opt/roundhouse/\.venv/bin/roundhouse ",
                           f"ExecStart={ROUNDHOUSE} ", text)
    assert starts == 1
    text = re.sub(r"(?m)^User=.*$", f"User={pwd.getpwuid(os.getuid()).pw_name}", text)
    text = re.sub(r"(?m)^Group=.*$", f"Group={grp.getgrgid(os.getgid()).gr_name}", text)
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                            text=True, timeout=60)
    output = result.stdout + result.stderr
    # Unknown keys and unparsable values are only warnings (exit status 0):
    # any line about our file is a failure.
    complaints = [line for line in output.splitlines() if UNIT.name in line]
    assert result.returncode == 0 and not complaints, output


def test_unit_is_a_notify_service_run_by_its_own_user(unit: Unit) -> None:
    assert value(unit, "Service", "Type") == "notify"
    # Engines inherit NOTIFY_SOCKET; only the router's own messages count.
    assert value(unit, "Service", "NotifyAccess") == "main"
    assert value(unit, "Service", "User") == "roundhouse"
    assert value(unit, "Service", "Group") == "roundhouse"
    assert value(unit, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert value(unit, "Service", "Restart") == "on-failure"
    assert value(unit, "Service", "KillMode") == "mixed"
    assert value(unit, "Service", "KillSignal") == "SIGTERM"
    assert value(unit, "Install", "WantedBy") == "multi-user.target"


def test_stop_timeout_covers_the_drain_and_the_engines(unit: Unit, env_text: str) -> None:
    """systemd SIGKILLs the service when TimeoutStopSec= runs out: that must
    come after the router's own shutdown could have ended, with room to spare."""
    argv = expand_command(value(unit, "Service", "ExecStart"), unit_environment(unit, env_text))
    config = parse_serve(argv[1:])
    stop_timeout = config.cli_model_options.get("stop-timeout", ModelSettings().stop_timeout)
    # Running requests' grace, then each engine: Shutdown, SIGTERM, SIGKILL,
    # each given --stop-timeout, then aiohttp's wait for the handlers.
    shutdown = config.shutdown_grace_seconds + 3 * stop_timeout + HANDLER_SHUTDOWN_SECONDS
    stop = float(value(unit, "Service", "TimeoutStopSec"))
    assert stop >= shutdown + 30, (stop, shutdown)


def test_unit_leaves_the_gpu_reachable(unit: Unit) -> None:
    service = dict(unit["Service"])
    # Each of these hides /dev/nvidia* or switches devices to an allow list.
    assert service.get("PrivateDevices", "no") == "no"
    assert "DeviceAllow" not in service and "DevicePolicy" not in service
    assert service.get("ProtectClock", "no") == "no"


def test_unit_directories_match_the_paths_the_router_uses(unit: Unit, env_text: str) -> None:
    env = unit_environment(unit, env_text)
    cache = "/var/cache/" + value(unit, "Service", "CacheDirectory")
    state = "/var/lib/" + value(unit, "Service", "StateDirectory")
    # router/paths.py reads ROUNDHOUSE_CACHE: it must be the writable cache directory.
    assert env["ROUNDHOUSE_CACHE"] == cache
    assert value(unit, "Service", "WorkingDirectory") == state
    config = parse_serve(expand_command(value(unit, "Service", "ExecStart"), env)[1:])
    assert config.models_dir is not None and str(config.models_dir).startswith(state + "/")


# ---------------------------------------------------------------------------
# ExecStart= with the environment file, against the real CLI.


def test_exec_start_expands_to_a_roundhouse_serve_command_that_parses(
        unit: Unit, env_text: str) -> None:
    assert value(unit, "Service", "EnvironmentFile") == "/etc/roundhouse/roundhouse.env"
    exec_start = value(unit, "Service", "ExecStart")
    # Unbraced, so systemd splits the options into words.
    assert exec_start.split()[-1] == "$ROUNDHOUSE_ARGS"
    argv = expand_command(exec_start, unit_environment(unit, env_text))
    assert argv[0] == "/opt/roundhouse/.venv/bin/roundhouse"
    assert Path(argv[0]).name == "roundhouse" and argv[1] == "serve"
    config = parse_serve(argv[1:])
    assert (config.host, config.port) == ("0.0.0.0", 8080)
    assert config.model is None and config.models_dir == Path("/var/lib/roundhouse/models")
    assert config.cli_model_options["device"] == "cuda"


def test_env_file_examples_use_options_that_exist(env_text: str) -> None:
    options = serve_options()
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", env_text))
    assert mentioned, "the environment file names no options"
    assert mentioned <= options, f"not options of `roundhouse serve`: {sorted(mentioned - options)}"


def test_env_file_commented_assignments_parse_too(unit: Unit, env_text: str) -> None:
    # Commented-out ROUNDHOUSE_ARGS= examples are meant to be uncommented as is.
    examples = [line.lstrip("#").strip() for line in env_text.splitlines()
                if re.match(r"#\s*ROUNDHOUSE_ARGS=", line)]
    assert examples
    for example in examples:
        env = unit_environment(unit, example + "\n")
        parse_serve(expand_command(value(unit, "Service", "ExecStart"), env)[1:])


def test_reader_follows_systemd_expansion_rules() -> None:
    env = parse_env_file('A="x  y"\n# B=no\n; C=no\nD=\'$A z\'\nE="say \\"hi\\""\n')
    assert env == {"A": "x  y", "D": "$A z", "E": 'say "hi"'}
    assert expand_command("/bin/p $A ${A} pre${D}post $MISSING cost=$$5", env) == [
        "/bin/p", "x", "y", "x  y", "pre$A zpost", "cost=$5"]


# ---------------------------------------------------------------------------
# router/systemd.py against a real notify socket.


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="rh-") as name:
        yield Path(name)


@pytest.fixture
def notify_socket(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's, named by NOTIFY_SOCKET, that
    reports each sender's pid as systemd sees it (SO_PASSCRED)."""
    path = short_dir / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def receive(sock: socket.socket, timeout: float) -> tuple[list[str], int] | None:
    """The next datagram's states and its sender's pid, or None after `timeout`."""
    sock.settimeout(timeout)
    try:
        data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("iII")))
    except TimeoutError:
        return None
    pid = -1
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("iII", payload[:struct.calcsize("iII")])[0]
    return data.decode().split("\n"), pid


def test_notify_sends_the_states_as_one_datagram(notify_socket: socket.socket) -> None:
    assert notify("READY=1", "STATUS=listening on 0.0.0.0:8080") is True
    assert receive(notify_socket, 5) == (["READY=1", "STATUS=listening on 0.0.0.0:8080"],
                                         os.getpid())
    assert notify("STOPPING=1") is True
    assert receive(notify_socket, 5) == (["STOPPING=1"], os.getpid())
    assert receive(notify_socket, 0.1) is None


def test_notify_reaches_an_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"roundhouse-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        reload_states = ("RELOADING=1", monotonic_usec())
        assert notify(*reload_states) is True
        sock.settimeout(5)
        assert sock.recv(4096).decode().split("\n") == list(reload_states)


def test_notify_without_systemd_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify("READY=1") is False


@pytest.mark.parametrize("address", [
    "/nonexistent/roundhouse/notify",   # no such socket
    "@roundhouse-nobody-listens-" + uuid.uuid4().hex,
    "relative/notify",                  # not an address libsystemd accepts
    "vsock:2:1234",                     # newer systemd's VSOCK form: not spoken
    "/" + "x" * 200,                    # longer than an AF_UNIX address can be
])
def test_notify_to_a_bad_address_returns_false(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture,
                                               address: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    with caplog.at_level("DEBUG", logger="router.systemd"):
        assert notify("READY=1") is False
    # Said at debug level only: outside systemd this is not worth a warning.
    assert caplog.records and all(r.levelname == "DEBUG" for r in caplog.records)


def test_notify_to_a_regular_file_returns_false(short_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = short_dir / "not-a-socket"
    path.write_text("")
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    assert notify("READY=1") is False


def test_monotonic_usec_reads_the_clock_systemd_compares_with() -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    key, _, usec = monotonic_usec().partition("=")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after


# ---------------------------------------------------------------------------
# `roundhouse serve` under a notify socket: the contract Type=notify relies on.


def wait_for_state(sock: socket.socket, state: str, timeout: float, server: Server) -> int:
    """Read datagrams until one holds `state`; returns that one's sender pid."""
    seen: list[list[str]] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        got = receive(sock, min(left, 0.5))
        if got is not None:
            seen.append(got[0])
            if state in got[0]:
                return got[1]
        elif server.process.poll() is not None:
            pytest.fail(f"server exited ({server.process.returncode}) before sending {state}; "
                        f"got {seen}\n{server.log()[-4000:]}")
    pytest.fail(f"no {state} within {timeout}s; got {seen}\n{server.log()[-4000:]}")


def start_server(args: list[str], log_path: Path) -> Server:
    port = free_port()
    with open(log_path, "wb") as log:
        # The unit runs the console script itself: the router is systemd's main pid.
        process = subprocess.Popen([str(ROUNDHOUSE), "serve", "--port", str(port), *args],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return Server(process, port, log_path)


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()


@pytest.mark.slow
def test_serve_sends_ready_once_its_port_is_bound(notify_socket: socket.socket,
                                                  tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    server = start_server([str(tiny_qwen3_dir), "--threads", "1"], tmp_path / "router.log")
    try:
        sender = wait_for_state(notify_socket, "READY=1", 30, server)
        assert sender == server.process.pid, "READY=1 must come from the main process"
        # No retry: the port is bound before READY=1 is sent. /health may say
        # 503 while the model loads; that still answers.
        assert requests.get(server.url + "/health", timeout=5).status_code in (200, 503)
        wait_until(lambda: requests.get(server.url + "/health", timeout=5).status_code == 200,
                   120, "the model to load", server)
        server.process.send_signal(signal.SIGTERM)
        wait_for_state(notify_socket, "STOPPING=1", 30, server)
        # 0 after SIGTERM: systemd counts it as a clean stop, not a failure to restart.
        assert server.process.wait(60) == 0, server.log()[-4000:]
    finally:
        stop_server(server)


@pytest.mark.slow
def test_sighup_reloads_between_reloading_and_ready(notify_socket: socket.socket,
                                                    tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "first").symlink_to(tiny_qwen3_dir, target_is_directory=True)
    server = start_server(["--models-dir", str(models), "--threads", "1"], tmp_path / "router.log")
    try:
        wait_for_state(notify_socket, "READY=1", 30, server)
        (models / "second").symlink_to(tiny_qwen3_dir, target_is_directory=True)
        # What `systemctl reload` does: ExecReload=/bin/kill -HUP $MAINPID.
        server.process.send_signal(signal.SIGHUP)
        wait_for_state(notify_socket, "RELOADING=1", 30, server)
        wait_for_state(notify_socket, "READY=1", 60, server)
        ids = {m["id"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]}
        assert {"first", "second"} <= ids
        server.process.send_signal(signal.SIGTERM)
        wait_for_state(notify_socket, "STOPPING=1", 30, server)
        assert server.process.wait(60) == 0, server.log()[-4000:]
    finally:
        stop_server(server)
