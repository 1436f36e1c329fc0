"""One record per API request, filled in as the request goes.

The observe middleware (router/http/observe.py) creates the record and puts it
in a context variable, so the code a request runs through fills it without
being handed it: the lease (model, admission), the generation (tokens, first
token) and the chat layer (reasoning tokens). Observers (metrics, the request
log, log lines) are told at each stage. A record never holds prompt or output
text.
"""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from aiohttp import web

from protocol import CacheHits

log = logging.getLogger(__name__)


def new_record_id() -> str:
    return "req-" + uuid.uuid4().hex[:16]


@dataclass
class RequestRecord:
    id: str = field(default_factory=new_record_id)
    # The client's own X-Request-Id, when it sent a valid one (it is then the
    # response's x-request-id; otherwise `id` is).
    client_request_id: str | None = None
    method: str = ""
    route: str = ""
    # "openai", "anthropic" or "llamacpp": whose error shape the route uses.
    api: str = ""
    # The label of the API key used ("cli-1", "env-2", "file-alice"); never the key.
    key_label: str | None = None
    model: str | None = None
    # The engine's request id (chatcmpl-..., msg_..., ...), once submitted.
    engine_request_id: str | None = None
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Of cached_tokens, how many each tier served: "device", "host", "disk"
    # (whole pages) and "partial" (a page's leading tokens).
    cached_by_tier: dict[str, int] = field(
        default_factory=lambda: msgspec.structs.asdict(CacheHits()))
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    finish_reason: str | None = None
    status: int | None = None
    # "ok", "rejected" (refused before it ran: 4xx, overload), "error" (5xx,
    # engine failure), "cancelled" (the client went away).
    outcome: str | None = None
    error_code: str | None = None
    observers: Observers | None = field(default=None, repr=False, compare=False)

    # ---- filled in by the code the request runs through -------------------

    def admit(self, model: str) -> None:
        """The lease got the model and a lane."""
        self.model = model
        self.admitted = time.monotonic()
        if self.observers is not None:
            self.observers.request_admitted(self)

    def report_cache_hits(self, hits: CacheHits) -> None:
        """The engine said where the prompt's cached tokens came from."""
        self.cached_by_tier = msgspec.structs.asdict(hits)

    def add_tokens(self, count: int) -> None:
        """An engine step gave this request `count` new tokens."""
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.completion_tokens += count
        if self.observers is not None:
            self.observers.tokens_generated(self, count, now)

    def stage_seconds(self) -> dict[str, float | None]:
        """Queue (arrival to admission), prefill (admission to first token),
        decode (first to last token), total."""
        def span(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else max(end - start, 0.0)

        return {
            "queue": span(self.arrived, self.admitted),
            "prefill": span(self.admitted, self.first_token),
            "decode": span(self.first_token, self.last_token),
            "total": span(self.arrived, self.finished),
        }


class RequestObserver(Protocol):
    """Hears about every request; each method must be cheap and never raise."""

    def request_started(self, record: RequestRecord) -> None: ...
    def request_admitted(self, record: RequestRecord) -> None: ...
    def tokens_generated(self, record: RequestRecord, count: int, now: float) -> None: ...
    def request_finished(self, record: RequestRecord) -> None: ...


class ModelObserver(Protocol):
    """Hears about lifecycle transitions: kind is load, wake, sleep, unload or
    fail; seconds is how long the transition took (0 when not measured)."""

    def model_event(self, model: str, kind: str, seconds: float) -> None: ...

    def model_evicted(self, model: str, action: str, reason: str, for_model: str,
                      device: str | None) -> None:
        """The planner evicted `model` (action: sleep or unload) to make room
        for `for_model`; reason: device_memory or models_max."""
        ...


# Where the observe middleware keeps a request's record.
RECORD: web.RequestKey[RequestRecord] = web.RequestKey("record", RequestRecord)

current_record: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "current_record", default=None
)


class Observers:
    """The observers of one server; calls fan out and a failing observer is
    logged, never allowed to fail the request."""

    def __init__(self) -> None:
        self.requests: list[RequestObserver] = []
        self.models: list[ModelObserver] = []

    def _each(self, observers: list, method: str, *args: object) -> None:  # type: ignore[type-arg]
        for observer in observers:
            try:
                getattr(observer, method)(*args)
            except Exception:
                log.exception("observer %s failed in %s", type(observer).__name__, method)

    def request_started(self, record: RequestRecord) -> None:
        self._each(self.requests, "request_started", record)

    def request_admitted(self, record: RequestRecord) -> None:
        self._each(self.requests, "request_admitted", record)

    def tokens_generated(self, record: RequestRecord, count: int, now: float) -> None:
        # Called for every engine step of every request: _each's lookup by
        # name is spared here.
        for observer in self.requests:
            try:
                observer.tokens_generated(record, count, now)
            except Exception:
                log.exception("observer %s failed in tokens_generated", type(observer).__name__)

    def request_finished(self, record: RequestRecord) -> None:
        self._each(self.requests, "request_finished", record)

    def model_event(self, model: str, kind: str, seconds: float) -> None:
        self._each(self.models, "model_event", model, kind, seconds)

    def model_evicted(self, model: str, action: str, reason: str, for_model: str,
                      device: str | None) -> None:
        self._each(self.models, "model_evicted", model, action, reason, for_model, device)
