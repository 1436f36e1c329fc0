"""Shared pieces of the lifecycle tests: a models directory of tiny models,
held-open streams, and pid checks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests.support.server import Server

TINY = ("qwen3-tiny", "qwen2-tiny", "llama-tiny")


def tiny_models_dir(directory: Path, tiny_model_factory: Any, smollm2: Path | None = None) -> Path:
    """The tiny random models, and SmolLM2 when a test needs a model that
    stays busy for long (a tiny model runs out of context in seconds)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in TINY:
        (directory / name).symlink_to(tiny_model_factory(name.split("-")[0]), target_is_directory=True)
    if smollm2 is not None:
        (directory / "smollm2.gguf").symlink_to(smollm2)
    return directory


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def card(server: Server, model: str) -> dict[str, Any]:
    return next(m for m in server.get("/models").json()["data"] if m["id"] == model)


def status(server: Server, model: str) -> str:
    return card(server, model)["status"]["value"]


def pid(server: Server, model: str) -> int:
    return server.load()[model]["pid"]


def complete(server: Server, model: str, max_tokens: int = 2, **query: str) -> requests.Response:
    return server.post("/v1/completions", params=query or None,
                       json={"model": model, "prompt": "hello", "max_tokens": max_tokens,
                             "temperature": 0})


@contextlib.contextmanager
def held_stream(server: Server, model: str) -> Iterator[requests.Response]:
    """A streamed request kept open (and its model busy) until the block ends;
    leaving the block closes the connection, which aborts the request."""
    # Within the tiny models' 2048-token context (a request asking for more is
    # refused at admission), and seconds of work even for them.
    body = {"model": model, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "temperature": 0}
    response = requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120)
    assert response.status_code == 200, response.text
    lines = response.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))
    try:
        yield response
    finally:
        response.close()


class Background:
    """Runs a request in a thread; .result() waits for its response."""

    def __init__(self, call: Any, *args: Any, **kwargs: Any):
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, call: Any, args: Any, kwargs: Any) -> None:
        try:
            self._result = call(*args, **kwargs)
        except BaseException as exc:  # handed to the test thread
            self._error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 120) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail(f"background request still running after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result
