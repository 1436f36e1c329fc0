"""Engines never outlive the router that started them."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int, poll_seconds: float = 1.0) -> None:
    """Ask the kernel to kill us when the parent dies (Linux), and also watch
    the parent pid from a thread, which covers other systems and the race
    where the parent died before prctl ran."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())

    def watch() -> None:
        while True:
            if os.getppid() != expected_parent:
                log.error("the router (pid %d) is gone; exiting", expected_parent)
                os._exit(1)
            time.sleep(poll_seconds)

    if os.getppid() != expected_parent:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
