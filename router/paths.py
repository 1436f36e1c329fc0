"""Where Roundhouse keeps what it fetches."""

from __future__ import annotations

import os
from pathlib import Path

from router import env


def cache_dir() -> Path:
    """ROUNDHOUSE_CACHE, else $XDG_CACHE_HOME/roundhouse, else ~/.cache/roundhouse."""
    explicit = os.environ.get(env.CACHE)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "roundhouse"
