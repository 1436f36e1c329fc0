"""Runs the router: bind the port first, then load, then serve until a signal."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop
from aiohttp import web

from router.app import create_app
from router.catalog import CatalogEntry, entry_for_path, scan_models_dir
from router.config import ServeConfig
from router.lifecycle import ModelManager

log = logging.getLogger("router")


def build_catalog(config: ServeConfig) -> dict[str, CatalogEntry]:
    if config.models_dir is not None:
        return scan_models_dir(config.models_dir)
    assert config.model is not None
    entry = entry_for_path(config.model)
    return {entry.id: entry}


async def run(config: ServeConfig) -> None:
    catalog = build_catalog(config)
    manager = ModelManager(catalog, config)
    app = create_app(manager)
    # handler_cancellation: a client that disconnects cancels its handler, whose
    # cleanup aborts the engine request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    # Bind before any model loads, so a port clash is reported at once.
    await site.start()
    log.info("listening on http://%s:%d (%d model%s)", config.host, config.port,
             len(catalog), "" if len(catalog) == 1 else "s")
    if manager.single:
        manager.preload(next(iter(manager.slots.values())))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


def serve(config: ServeConfig) -> int:
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(run(config))
    except OSError as exc:
        log.error("cannot serve on %s:%d: %s", config.host, config.port, exc)
        return 1
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    return 0
