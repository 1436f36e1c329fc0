"""Client connections: time limits for slow clients, and a bound on how many.

aiohttp closes idle keep-alive connections, but has no limit on a client that
sends its headers or its body a byte at a time, or nothing at all: each such
socket would hold a file descriptor and a little memory for ever (slowloris).
So each connection is a GuardedRequestHandler, made by GuardedSite:

- headers: a request's headers must be in within --http-header-timeout-ms of
  the connection's opening (its first request) or of the first byte of the
  request (later ones); else the server answers a bare 408, when some bytes
  came, and closes the connection;
- body: once the headers are in, the body must be in within
  --http-body-timeout-ms (body_timeout_middleware): 408 request_body_timeout,
  then the connection is closed;
- idle: a keep-alive connection is closed --http-keepalive-timeout-ms after
  its last response unless the next request started;
- count: past --max-connections a new connection gets a bare 503 and is
  closed at once.

No limit runs while a handler runs or its response goes out: an SSE stream
may last minutes. The handler learns that a request started from
busy_middleware (the outermost), and that it ended from finish_response.
One timer per connection does all three deadlines; aiohttp's own keep-alive
timer stays at its default (an hour), a backstop that never bites first.
Each limit that bites but the idle one says so in a warning, at most one a
minute per kind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from router.config import ServeConfig
from router.http.errors import ApiError
from router.http.route_info import route_of

log = logging.getLogger(__name__)

# Answers written straight to the socket: there is no request to answer yet.
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
           b"Content-Length: 21\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
           b"too many connections\n")
HEADERS_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
# At most one warning a minute per kind of limit.
LOG_INTERVAL_SECONDS = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int

    @classmethod
    def from_config(cls, config: ServeConfig) -> ConnectionLimits:
        return cls(config.http_header_timeout_ms / 1000, config.http_body_timeout_ms / 1000,
                   config.http_keepalive_timeout_ms / 1000, config.max_connections)


class RateLimitedWarning:
    """A warning at most once per interval; the next one says how many were
    held back."""

    def __init__(self, interval: float = LOG_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self._interval = interval
        self._clock = clock
        self._next = 0.0
        self._held = 0

    def warn(self, message: str, *args: object) -> None:
        now = self._clock()
        if now < self._next:
            self._held += 1
            return
        self._next = now + self._interval
        if self._held:
            message += f" ({self._held} more like it since the last such line)"
            self._held = 0
        log.warning(message, *args)


class ConnectionGuard:
    """The count of open connections and the warnings of one site."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open = 0
        self._refusals = RateLimitedWarning()
        self._header_timeouts = RateLimitedWarning()
        self._body_timeouts = RateLimitedWarning()

    def refused(self, peer: object) -> None:
        self._refusals.warn("refused a connection from %s: %d connections are open "
                            "(--max-connections)", _address(peer), self.open)

    def headers_timed_out(self, peer: object) -> None:
        self._header_timeouts.warn("closed a connection from %s: no complete request headers "
                                   "within %g s (--http-header-timeout-ms)", _address(peer),
                                   self.limits.header_timeout)

    def body_timed_out(self, peer: object) -> None:
        self._body_timeouts.warn("closed a connection from %s: the request body was not in "
                                 "within %g s (--http-body-timeout-ms)", _address(peer),
                                 self.limits.body_timeout)


def _address(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host, port = peer[0], peer[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peer)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection handler with the header and body deadlines and
    the connection bound."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._refused = False
        # A request is being handled (its handler runs or its response goes out).
        self._busy = False
        # Bytes of a request that has not started yet arrived.
        self._partial = False
        self._close_after = False
        self._deadline: asyncio.TimerHandle | None = None
        # What the deadline waits for: a request's headers, or (idle) its first byte.
        self._idle = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._guard.open >= self._guard.limits.max_connections:
            self._refused = True
            self._guard.refused(transport.get_extra_info("peername"))
            # uvloop's transports are no asyncio.Transport subclass, but write alike.
            cast(asyncio.Transport, transport).write(REFUSED)
            transport.close()
            return
        self._guard.open += 1
        super().connection_made(transport)
        self._arm(idle=False)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._guard.open -= 1
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and not self._busy:
            if self._idle:
                # The first byte of a later request on a kept-alive connection.
                self._arm(idle=False)
            self._partial = True
        super().data_received(data)

    def request_started(self) -> None:
        """busy_middleware: the headers are in and the app has the request."""
        self._busy = True
        self._partial = False
        self._disarm()

    def body_timed_out(self) -> None:
        """body_timeout_middleware: the body came too slowly; close after the 408."""
        self._close_after = True
        self._guard.body_timed_out(self.peername)

    async def finish_response(self, request: BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._busy = False
            self._partial = False
            if self._close_after:
                # Now, rather than after aiohttp reads and drops the rest of the
                # body for up to its lingering time.
                self.force_close()
            elif self.transport is not None:
                self._arm(idle=True)

    def _arm(self, *, idle: bool) -> None:
        self._disarm()
        self._idle = idle
        limits = self._guard.limits
        seconds = limits.keepalive_timeout if idle else limits.header_timeout
        self._deadline = self._loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        transport = self.transport
        if self._busy or transport is None:
            return
        if not self._idle:
            self._guard.headers_timed_out(self.peername)
            if self._partial:
                transport.write(HEADERS_TIMED_OUT)
        self.force_close()


class GuardedSite(web.BaseSite):
    """A TCP site like web.TCPSite whose connections are GuardedRequestHandlers.
    The runner stops it as any site (runner.cleanup())."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: ConnectionLimits):
        super().__init__(runner)
        self._host = host
        self._port = port
        self.guard = ConnectionGuard(limits)

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        def new_connection() -> GuardedRequestHandler:
            # access_log=None as the runner's: the request log and log lines
            # (router/observability) say what happened.
            return GuardedRequestHandler(server, guard=self.guard, loop=loop, access_log=None)

        self._server = await loop.create_server(new_connection, self._host, self._port,
                                                backlog=self._backlog)


@web.middleware
async def busy_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """The outermost middleware: tells the connection its request started, so
    that no deadline cuts a handler or a stream."""
    protocol = request.protocol
    if isinstance(protocol, GuardedRequestHandler):
        protocol.request_started()
    return await handler(request)


def body_timeout_middleware(seconds: float) -> Middleware:
    """Reads a routed request's body within `seconds` (handlers then get it
    from request.read()'s cache). It runs after the API key check, so a
    stranger cannot make the server buffer bodies."""
    @web.middleware
    async def read_body_in_time(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.body_exists and route_of(request) is not None:
            try:
                async with asyncio.timeout(seconds):
                    await request.read()
            except TimeoutError:
                protocol = request.protocol
                if isinstance(protocol, GuardedRequestHandler):
                    protocol.body_timed_out()
                raise ApiError(408, f"the request body was not in within {seconds:g} s "
                                    "(--http-body-timeout-ms)", code="request_body_timeout") from None
        return await handler(request)

    return read_body_in_time
