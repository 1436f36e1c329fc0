"""Every environment variable Roundhouse reads, in one place.

ROUNDHOUSE_CACHE          where fetched models and test fixtures are kept
                          (default $XDG_CACHE_HOME/roundhouse or ~/.cache/roundhouse)
ROUNDHOUSE_API_KEY        API keys clients must send, comma-separated (labels env-1, ...)
ROUNDHOUSE_ENGINE_MODULE  the Python module the supervisor runs as an engine
                          (default "engine"); the protocol tests put a scripted
                          engine behind the real router with it
NOTIFY_SOCKET             systemd's notification socket (router/systemd.py)
"""

from __future__ import annotations

import os

API_KEY = "ROUNDHOUSE_API_KEY"
CACHE = "ROUNDHOUSE_CACHE"
ENGINE_MODULE = "ROUNDHOUSE_ENGINE_MODULE"


def engine_module() -> str:
    return os.environ.get(ENGINE_MODULE) or "engine"


def api_keys_from_environment() -> tuple[str, ...]:
    return tuple(key.strip() for key in os.environ.get(API_KEY, "").split(",") if key.strip())
