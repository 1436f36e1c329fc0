"""Watches GET /models/sse from a thread and keeps every event."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

import requests


class SseWatcher:
    def __init__(self, url: str):
        self.events: list[dict[str, Any]] = []
        self.comments: list[str] = []
        self._connected = threading.Event()
        self._response = requests.get(url, stream=True, timeout=(5, None))
        self._response.raise_for_status()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        if not self._connected.wait(10):
            raise AssertionError("the event stream never said it was connected")

    def _read(self) -> None:
        try:
            for raw in self._response.iter_lines():
                line = raw.decode()
                if line.startswith(":"):
                    self.comments.append(line[1:].strip())
                    if line.startswith(": connected"):
                        self._connected.set()
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[len("data: "):]))
        except (requests.RequestException, OSError, AttributeError):
            pass  # close() pulled the connection from under the reader

    def statuses(self, model: str) -> list[str]:
        """The model's status values in order, progress repeats folded."""
        values: list[str] = []
        for event in self.events:
            if event.get("model") == model and event.get("event") == "model_status":
                status = event["data"]["status"]
                if not values or values[-1] != status:
                    values.append(status)
        return values

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "an event") -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; events: {self.events}")

    def close(self) -> None:
        # NOTE: closing the response alone waits for the reader's blocked read
        # to return (the buffered reader's lock), that is for the server's next
        # keepalive comment: 5 s a close. Shutting the socket down ends the
        # stream now; the reader still takes every event already received.
        connection = self._response.raw.connection
        if connection is not None and connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        self._response.close()
