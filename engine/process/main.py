"""Engine process start-up: connect, load, size KV, handshake, serve.

Exit status: 0 after a Shutdown; 1 after an engine-wide failure, which is first
reported to the router as EngineDead (with the traceback).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import time
import traceback
from pathlib import Path

from engine.process.ipc import EngineSockets
from engine.process.parent_watch import die_with_parent
from protocol import EngineDead, EngineOptions, LoadProgress

log = logging.getLogger("engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--options", default="{}", type=EngineOptions.from_json,
                        help="EngineOptions as JSON (protocol/launch.py)")
    parser.add_argument("--input", required=True, help="ZMQ address to receive commands on")
    parser.add_argument("--output", required=True, help="ZMQ address to send events to")
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--name", default="", help="model id, for log lines")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


class ProgressReporter:
    """Forwards load progress to the router and the log, about every 5%."""

    def __init__(self, sockets: EngineSockets):
        self._sockets = sockets
        self._last = -1.0

    def __call__(self, fraction: float, message: str) -> None:
        if fraction < 1.0 and fraction - self._last < 0.05:
            return
        self._last = fraction
        log.info("loading %3.0f%% %s", fraction * 100, message)
        self._sockets.emit(LoadProgress(fraction, message))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The router's line format (router/observability/logging_setup.py, which
    # the engine may not import): the router forwards these lines after a
    # `[model]` prefix, and they read the same as its own.
    formatter = logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(message)s",
                                  "%Y-%m-%d %H:%M:%S")
    formatter.converter = time.gmtime
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if args.parent_pid:
        die_with_parent(args.parent_pid)
        # Ctrl-C in a terminal signals the whole process group: the router
        # drains its requests and then sends Shutdown, which this engine must
        # live to act on (it dies with the router anyway).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sockets = EngineSockets(args.input, args.output)
    sockets.start_output()
    try:
        # Imported here so a bad argument fails before torch's import cost.
        from engine.process.bootstrap import build_engine

        started = time.monotonic()
        core, ready = build_engine(args.model, args.options, ProgressReporter(sockets), sockets.emit)
        ready.load_seconds = time.monotonic() - started
        # Full collections walk every object the process holds (20-70 ms for
        # a loaded engine on the H200 host, a stall every stream feels):
        # what exists now lives as long as the engine, so hide it from them.
        gc.collect()
        gc.freeze()
        sockets.emit(ready)
        log.info("ready in %.1fs (pid %d)", ready.load_seconds, os.getpid())
        sockets.start_input()
        core.run(sockets.commands)
    except Exception as exc:
        log.exception("engine failed")
        sockets.emit(EngineDead(message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()))
        sockets.close()
        return 1
    sockets.close()
    log.info("shut down")
    return 0
