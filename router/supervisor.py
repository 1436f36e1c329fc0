"""Starts, watches and stops one engine process.

The engine is `python -m engine`, connected back to this router over two
ipc:// sockets in the router's run directory. Start-up waits for its Ready
handshake (protocol version, model and KV facts) under a timeout; an engine
that exits or reports failure first makes the load fail with the last lines
it printed, so the user sees why. Its output is forwarded to our log with the
model's name in front.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from protocol import PROTOCOL_VERSION, LoadProgress, Ready
from router.catalog import CatalogEntry
from router.engine_client import EngineClient
from router.env import engine_module

log = logging.getLogger(__name__)

# Lines of engine output kept to explain a failed start.
TAIL_LINES = 30


class EngineStartError(RuntimeError):
    pass


def engine_args(entry: CatalogEntry) -> list[str]:
    """The engine's command line, less the per-run socket addresses; it logs
    at the router's level."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return [
        sys.executable, "-m", engine_module(),
        "--model", str(entry.path),
        "--name", entry.id,
        "--options", entry.settings.engine.to_json(),
        "--log-level", level,
    ]


# The engine's log line: "YYYY-MM-DD HH:MM:SS.mmm LEVEL message".
_ENGINE_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} "
                          r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)$")


def engine_line(line: str) -> tuple[int, str]:
    """The level and text of one line of engine output: its own log lines
    keep their level (the router's line adds the time again); anything else
    (a traceback, a library's print) is INFO."""
    match = _ENGINE_LINE.match(line)
    if match is None:
        return logging.INFO, line
    return logging.getLevelName(match[1]), match[2]


class EngineProcess:
    def __init__(self, entry: CatalogEntry, run_dir: Path, serial: int):
        self.entry = entry
        self.client = EngineClient(run_dir, f"{_slug(entry.id)}-{serial}")
        self.process: asyncio.subprocess.Process | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._pump: asyncio.Task[None] | None = None
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.stopping = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def tail(self) -> str:
        return "\n".join(self._tail)

    async def start(self, ready_within: float, on_progress: Callable[[LoadProgress], None]) -> Ready:
        self.client.on_progress = on_progress
        argv = [
            *engine_args(self.entry),
            "--input", self.client.input_address,
            "--output", self.client.output_address,
            "--parent-pid", str(os.getpid()),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log.info("starting engine for %s: %s", self.entry.id, self.entry.path)
        self.process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
        self._pump = asyncio.create_task(self._forward_output(), name=f"engine-log-{self.entry.id}")
        waiters = {self.client.ready, self.client.dead, self.exited}
        done, _ = await asyncio.wait(waiters, timeout=ready_within, return_when=asyncio.FIRST_COMPLETED)
        if self.client.ready in done:
            ready = self.client.ready.result()
            if ready.protocol_version != PROTOCOL_VERSION:
                raise EngineStartError(
                    f"engine speaks protocol {ready.protocol_version}, router {PROTOCOL_VERSION}: "
                    "reinstall Roundhouse so both come from one version"
                )
            return ready
        if not done:
            raise EngineStartError(
                f"engine for {self.entry.id} did not become ready within {ready_within:.0f}s "
                f"(raise --load-timeout for large models); last output:\n{self.tail()}"
            )
        if self.client.dead.done():
            reason = self.client.dead.result()
        else:
            reason = f"engine exited with status {self.exited.result()} before it was ready"
        raise EngineStartError(f"{reason}\n{self.tail()}".strip())

    async def _forward_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._tail.append(line)
                level, text = engine_line(line)
                log.log(level, "[%s] %s", self.entry.id, text)
        code = await self.process.wait()
        if not self.exited.done():
            self.exited.set_result(code)
        if not self.stopping:
            self.client.fail_all(f"engine process exited with status {code}")

    async def stop(self, reason: str = "the model was unloaded",
                   code: str = "engine_failed") -> None:
        """Ask the engine to shut down; terminate, then kill, if it won't
        (each after the model's stop timeout). Requests still open end with
        an error (`reason`) at once, and the engine is told to abort them
        before it gets Shutdown, so it exits 0 with nothing left over."""
        self.stopping = True
        grace = self.entry.settings.stop_timeout
        process = self.process
        self.client.end_all(reason, code)
        if process is not None and process.returncode is None:
            self.client.shutdown()
            for action in (None, process.terminate, process.kill):
                if action is not None:
                    log.warning("engine for %s (pid %d) did not stop; %s",
                                self.entry.id, process.pid, action.__name__)
                    action()
                try:
                    await asyncio.wait_for(asyncio.shield(self.exited), grace)
                    break
                except TimeoutError:
                    continue
            if self.exited.done():
                log.info("engine for %s stopped (exit status %d)", self.entry.id,
                         self.exited.result())
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)
        self.client.fail_all(reason)
        self.client.close()

    async def kill(self, grace: float = 0.0) -> None:
        """End a failed engine: give it `grace` seconds to exit on its own (one
        that reported EngineDead is on its way out, with a telling exit
        status), then kill it."""
        self.stopping = True
        if self.process is not None and self.process.returncode is None:
            if grace:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.exited), grace)
            if self.process.returncode is None:
                self.process.kill()
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)
        self.client.fail_all("the engine was stopped")
        self.client.close()


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40]
