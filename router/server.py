"""Runs the router: bind the port first, then load, then serve until a signal.

Exit status: 0 after SIGTERM/SIGINT; 1 when start-up fails (bad catalog,
port in use, a single model that cannot load); 2 when a single-model server's
engine fails later, so a supervisor such as systemd restarts it.
SIGHUP rescans --models-dir and --models-preset and re-reads --api-key-file.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sys

import uvloop
from aiohttp import web

from router.app import create_app
from router.catalog import build_catalog
from router.config import ServeConfig
from router.heap import freeze_long_lived
from router.http.auth import KEY_STORE, AuthConfigError, KeyStore
from router.http.connections import ConnectionLimits, GuardedSite
from router.lifecycle import ModelManager
from router.lifecycle.manager import EXIT_STARTUP_FAILED
from router.lifecycle.reload import reload_catalog
from router.observability.operator_logs import OperatorLogs
from router.systemd import monotonic_usec, notify

log = logging.getLogger("router")

# Seconds aiohttp gives handlers to finish once the engines are stopped.
HANDLER_SHUTDOWN_SECONDS = 10.0


async def run(config: ServeConfig) -> int:
    try:
        catalog = build_catalog(config)
    except ValueError as exc:
        log.error("%s", exc)
        return EXIT_STARTUP_FAILED
    try:
        operator_logs = OperatorLogs.open(config, catalog, sys.argv)
    except OSError as exc:
        log.error("cannot write the request log: %s", exc)
        return EXIT_STARTUP_FAILED
    manager = ModelManager(catalog, config)
    operator_logs.attach(manager)
    try:
        app = create_app(manager)
    except AuthConfigError as exc:
        log.error("%s", exc)
        await manager.close()
        await operator_logs.close(EXIT_STARTUP_FAILED)
        return EXIT_STARTUP_FAILED
    keys = app[KEY_STORE]
    # handler_cancellation: a client that disconnects cancels its handler, whose
    # cleanup aborts the engine request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=HANDLER_SHUTDOWN_SECONDS)
    await runner.setup()
    # Its connections carry the header/body deadlines and the connection bound.
    site = GuardedSite(runner, config.host, config.port, ConnectionLimits.from_config(config))
    try:
        # Bind before any model loads, so a port clash is reported at once.
        await site.start()
    except OSError as exc:
        log.error("cannot serve on %s:%d: %s", config.host, config.port, exc)
        await runner.cleanup()
        await operator_logs.close(EXIT_STARTUP_FAILED)
        return EXIT_STARTUP_FAILED
    # Handlers first: once READY=1 is out, systemd may send SIGHUP at once.
    stop = asyncio.Event()
    # A second SIGTERM/SIGINT during the drain ends it at once.
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, _on_stop_signal, stop, hurry)
    loop.add_signal_handler(signal.SIGHUP, _on_sighup, manager, keys)
    count = len(catalog.entries)
    log.info("listening on http://%s:%d (%d model%s)", config.host, config.port,
             count, "" if count == 1 else "s")
    _log_access(config, keys)
    notify("READY=1", f"STATUS=listening on {config.host}:{config.port}")
    # Nothing streams yet: what exists now lives as long as the server.
    freeze_long_lived(collect_first=True)
    manager.start()

    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({stopping, manager.fatal}, return_when=asyncio.FIRST_COMPLETED)
    status = manager.fatal.result() if manager.fatal.done() else 0
    stopping.cancel()
    log.info("shutting down%s", f" (exit status {status})" if status else "")
    notify("STOPPING=1")
    # Stop admitting first (new and queued requests get 503 shutting_down,
    # the port stays open to say so); running requests get
    # --shutdown-grace-seconds to finish. runner.cleanup() then closes the
    # listener, ends what still runs (an error event or 503) and stops the
    # engines (on_shutdown), and waits for the handlers.
    manager.begin_shutdown()
    if not status:
        await _drain(manager, config.shutdown_grace_seconds, hurry)
    await runner.cleanup()
    # After the handlers: the requests that shutdown ended are in the log.
    await operator_logs.close(status)
    return status


def _on_stop_signal(stop: asyncio.Event, hurry: asyncio.Event) -> None:
    if stop.is_set():
        log.warning("second stop signal: ending the requests still running now")
        hurry.set()
    stop.set()


async def _drain(manager: ModelManager, grace: float, hurry: asyncio.Event) -> None:
    # One turn first: the queued requests that begin_shutdown refused leave.
    await asyncio.sleep(0)
    running = manager.in_flight
    if not running:
        return
    log.info("waiting up to %gs for %d running request%s to finish (--shutdown-grace-seconds)",
             grace, running, "" if running == 1 else "s")
    notify(f"STATUS=draining {running} request(s)")
    if await manager.drain(grace, hurry):
        log.info("every running request finished")
    else:
        left = manager.in_flight
        log.warning("%d request%s still running after the grace period; ending %s with an error",
                    left, "" if left == 1 else "s", "it" if left == 1 else "them")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _log_access(config: ServeConfig, keys: KeyStore) -> None:
    if keys.enabled:
        # Labels only: they say which keys exist without saying what they are.
        log.info("API keys required (%s)", ", ".join(keys.labels))
    elif not _is_loopback(config.host):
        log.warning("listening on %s without API keys: anyone who can reach it can use every "
                    "model; give --api-key, $ROUNDHOUSE_API_KEY or --api-key-file "
                    "(docs/security.md)", config.host)


def _on_sighup(manager: ModelManager, keys: KeyStore) -> None:
    # The key file first and at once: it is quick, and a rotated key should
    # work before a slow catalog rescan ends.
    keys.reload()
    manager.spawn(_reload(manager), "sighup-reload")


async def _reload(manager: ModelManager) -> None:
    notify("RELOADING=1", monotonic_usec())
    try:
        await reload_catalog(manager)
    except ValueError as exc:
        log.error("SIGHUP reload failed, catalog unchanged: %s", exc)
    finally:
        notify("READY=1")


def serve(config: ServeConfig) -> int:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run(config))
