"""Typed keys for what the application object carries."""

from __future__ import annotations

from aiohttp import web

from router.lifecycle import ModelManager
from router.media.image_loader import ImageLoader

MANAGER = web.AppKey("manager", ModelManager)
# The requests' images: the --media-* limits and the one URL fetcher.
IMAGES = web.AppKey("images", ImageLoader)
STARTED = web.AppKey("started", int)
