"""Typed keys for what the application object carries."""

from __future__ import annotations

from aiohttp import web

from router.lifecycle import ModelManager

MANAGER = web.AppKey("manager", ModelManager)
STARTED = web.AppKey("started", int)
