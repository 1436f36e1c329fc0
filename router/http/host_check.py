"""DNS-rebinding protection: the Host header must name this server.

A page on evil.example can have a browser resolve evil.example to 127.0.0.1
(DNS rebinding). Its requests then reach a server on loopback as same-origin
requests, with `Host: evil.example`, and the page reads every answer: no CORS
stands in the way (Ollama's CVE-2024-28224). So a server bound to loopback
accepts only Host values that name loopback: `localhost`, `*.localhost`,
127.0.0.0/8 addresses and `[::1]`, with any port, plus the names given with
--allowed-host (`*`: any). The check holds with or without API keys: a key
stops strangers, but a page in the user's own browser may find one in a
config the user pasted. On other binds the Host names are the operator's
(addresses, DNS names), so the check applies only when --allowed-host is given.

A request without a Host header passes: browsers always send one, so it does
not come from a web page.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from router.config import ServeConfig
from router.http.errors import ApiError

ANY_HOST = "*"
# A DNS name (letters, digits, '-', '.', '_' as some internal names have) or
# an IPv4 address; an IPv6 address comes in brackets.
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]{0,252})\Z")
# What a refusal quotes of the Host header it refused.
_QUOTED_CHARS = 100


def allowed_host(text: str) -> str:
    """One --allowed-host value, lower-cased: a name, an address, or '*'."""
    host = text.strip().lower().rstrip(".")
    if host == ANY_HOST:
        return host
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise ValueError(f"--allowed-host {text!r}: not an IPv6 address") from None
    if ":" in host:
        raise ValueError(f"--allowed-host {text!r}: give the host without a port (any port "
                         "is accepted); an IPv6 address goes in brackets")
    if not _NAME.match(host):
        raise ValueError(f"--allowed-host {text!r}: not a host name or address")
    return host


def host_name(header: str) -> str:
    """The host of a Host header, lower-cased, without its port or brackets."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    else:
        host = host.partition(":")[0]
    return host.rstrip(".")


def names_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_bind(address: str) -> bool:
    """--host names loopback: 127.0.0.0/8, ::1 or localhost."""
    return names_loopback(address.strip().strip("[]").lower())


def _canonical(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def host_check_middleware(config: ServeConfig) -> Middleware | None:
    """The middleware for this server, or None where no check applies: a
    non-loopback bind without --allowed-host, or --allowed-host '*'."""
    allowed = frozenset(_canonical(host) for host in config.allowed_hosts)
    if ANY_HOST in allowed or not (is_loopback_bind(config.host) or allowed):
        return None

    @web.middleware
    async def check_host(request: web.Request, handler: Any) -> web.StreamResponse:
        header = request.headers.get("Host", "")
        host = _canonical(host_name(header))
        if header.strip() and not names_loopback(host) and host not in allowed:
            raise ApiError(403, f"the Host header {header[:_QUOTED_CHARS]!r} is not allowed: "
                                "this server answers localhost and loopback addresses only; "
                                "start it with --allowed-host NAME to accept another name "
                                "(docs/security.md)",
                           type="permission_error", code="host_not_allowed")
        return await handler(request)

    return check_host
