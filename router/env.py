"""Every environment variable Roundhouse reads, in one place.

ROUNDHOUSE_CACHE          where fetched models and test fixtures are kept
                          (default $XDG_CACHE_HOME/roundhouse or ~/.cache/roundhouse)
ROUNDHOUSE_API_KEY        API keys clients must send, comma-separated (labels env-1, ...);
                          set but empty (or with an empty key) refuses to start
ROUNDHOUSE_ENGINE_MODULE  the Python module the supervisor runs as an engine
                          (default "engine"); the protocol tests put a scripted
                          engine behind the real router with it
ROUNDHOUSE_SSE_KEEPALIVE  seconds of silence after which a streamed answer sends
                          its API's keep-alive (default 5; router/http/sse.py)
NOTIFY_SOCKET             systemd's notification socket (router/systemd.py)
"""

from __future__ import annotations

import os

API_KEY = "ROUNDHOUSE_API_KEY"
CACHE = "ROUNDHOUSE_CACHE"
ENGINE_MODULE = "ROUNDHOUSE_ENGINE_MODULE"
SSE_KEEPALIVE = "ROUNDHOUSE_SSE_KEEPALIVE"


def engine_module() -> str:
    return os.environ.get(ENGINE_MODULE) or "engine"


def sse_keepalive_seconds(default: float = 5.0) -> float:
    """ROUNDHOUSE_SSE_KEEPALIVE: a positive number of seconds, else the default."""
    try:
        value = float(os.environ.get(SSE_KEEPALIVE) or default)
    except ValueError:
        return default
    return value if value > 0 else default


def api_keys_from_environment() -> tuple[str, ...]:
    """The keys of ROUNDHOUSE_API_KEY. Set but holding an empty key ("", ",,",
    "sk-a,") is an error, as `--api-key ''` is: a typo must not start a server
    without keys."""
    value = os.environ.get(API_KEY)
    if value is None:
        return ()
    keys = tuple(key.strip() for key in value.split(","))
    if not any(keys):
        raise ValueError(f"${API_KEY} is set but holds no key; unset it to serve without keys")
    if "" in keys:
        raise ValueError(f"${API_KEY}: key {keys.index('') + 1} is empty (a comma too many?)")
    return keys
