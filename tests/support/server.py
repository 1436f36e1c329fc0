"""A real `roundhouse serve` subprocess on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kwargs: object) -> requests.Response:
        return requests.get(self.url + path, timeout=60, **kwargs)  # type: ignore[arg-type]

    def post(self, path: str, **kwargs: object) -> requests.Response:
        return requests.post(self.url + path, timeout=300, **kwargs)  # type: ignore[arg-type]

    def load(self) -> dict[str, dict]:
        """/v1/load by model; a single-model server answers with its one object."""
        body = self.get("/v1/load").json()
        return {m["model"]: m for m in body.get("models", [body])}


def wait_until(predicate, timeout: float, what: str, server: Server | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if server is not None and server.process.poll() is not None:
            raise AssertionError(f"server exited while waiting for {what}:\n{server.log()[-4000:]}")
        time.sleep(0.1)
    tail = server.log()[-4000:] if server is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tail}")


@contextmanager
def running_server(args: list[str], log_path: Path, *, ready_path: str = "/health",
                   timeout: float = 180.0, env: dict[str, str] | None = None,
                   launcher: tuple[str, ...] = ("-m", "router"),
                   stop_timeout: float = 30.0) -> Iterator[Server]:
    """`python <launcher> serve` on a free port until ready_path answers 200;
    stopped with SIGTERM (killed after stop_timeout seconds)."""
    port = free_port()
    log_file = open(log_path, "wb")
    process = subprocess.Popen(
        [sys.executable, *launcher, "serve", "--port", str(port), *args],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    server = Server(process, port, log_path)

    def ready() -> bool:
        try:
            return requests.get(server.url + ready_path, timeout=2).status_code == 200
        except requests.RequestException:
            return False

    try:
        wait_until(ready, timeout, f"{ready_path} to answer 200", server)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log_file.close()
