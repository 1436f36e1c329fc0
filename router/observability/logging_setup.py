"""The operational log's one line format, for the router and (copied, since
the engine may not import the router) engine/process/main.py:

    2026-11-29 20:27:32.123 INFO message

Times are UTC, as the request log's `ts` is, so a line and an event line up.
The logger's name is left out: the message says what it is about, and engine
lines forwarded by the router carry their model's name as `[model]`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

LINE_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
# What a line starts with, for tests and log scrapers.
LINE_PATTERN = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "


def line_formatter() -> logging.Formatter:
    formatter = logging.Formatter(LINE_FORMAT, DATE_FORMAT)
    # An instance attribute, so no other formatter in the process changes.
    formatter.converter = time.gmtime
    return formatter


def configure_logging(level: str, stream: TextIO | None = None) -> None:
    """Send every logger's lines at `level` and above to stderr (or `stream`)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(line_formatter())
    # Like any basicConfig, a no-op when the root logger has handlers already
    # (an embedding program, pytest's log capture).
    logging.basicConfig(level=level.upper(), handlers=[handler])
