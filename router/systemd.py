"""The sd_notify protocol, so a `Type=notify` unit knows how the router is doing.

systemd passes the address of a datagram socket in $NOTIFY_SOCKET; a service
reports its state by sending newline-separated `KEY=VALUE` lines to it in one
datagram: `READY=1` (start-up is done: for us, the HTTP port is bound),
`STOPPING=1`, `RELOADING=1` (followed by `READY=1` when the reload is over),
`STATUS=...` (free text for `systemctl status`). See sd_notify(3).

Written here rather than taken from libsystemd or a PyPI binding: it is one
sendto(), and the router must start anywhere, systemd or not.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("router.systemd")


def notify(*states: str) -> bool:
    """Send `states` (e.g. "READY=1", "STATUS=listening on :8080") to systemd
    as one datagram. Returns True when it was sent; False when not running
    under a notify-type unit, when there is nothing to send, or when the
    socket can't be reached. Never raises: a lost status message must not
    take the server down."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not states:
        return False
    # libsystemd accepts only these two forms of an AF_UNIX address; newer
    # systemd may also hand out "vsock:..." addresses, which we don't speak.
    if address[0] == "@":
        # Abstract namespace: the name starts with a NUL byte, not '@'.
        address = "\0" + address[1:]
    elif address[0] != "/":
        log.debug("NOTIFY_SOCKET=%r is not an AF_UNIX address; not notifying", address)
        return False
    payload = "\n".join(states).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(payload, address)
    except (OSError, ValueError) as exc:
        # ValueError: an address Python refuses outright (e.g. a NUL inside it).
        log.debug("cannot notify systemd at %r: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def monotonic_usec() -> str:
    """The `MONOTONIC_USEC=` state to send with `RELOADING=1`: systemd (253+,
    `Type=notify-reload`) uses the timestamp to tell this reload from a stale
    one, and compares it with CLOCK_MONOTONIC, so that clock is read by name."""
    return f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
