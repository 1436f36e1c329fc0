"""The router's domain errors: what went wrong, in the router's own words.

Lifecycle, admission, generation, sampling and text code raise these; they
know nothing of HTTP. One place (router/http/errors.py) maps each kind to a
status and each API's error shape (OpenAI, Anthropic, llama.cpp), so the same
failure reads right in every protocol and no domain module imports the HTTP
layer.
"""

from __future__ import annotations

import enum
from typing import Any


class ErrorKind(enum.Enum):
    INVALID = "invalid"  # the request itself is wrong: 400
    UNAUTHORIZED = "unauthorized"  # 401
    FORBIDDEN = "forbidden"  # 403
    NOT_FOUND = "not_found"  # 404
    NOT_ALLOWED = "not_allowed"  # 405
    CONFLICT = "conflict"  # the target's state forbids it now: 409
    TOO_LARGE = "too_large"  # 413
    OVERLOADED = "overloaded"  # a bounded queue is full: 429
    INTERNAL = "internal"  # 500
    UNAVAILABLE = "unavailable"  # the model or server cannot serve it now: 503
    TIMEOUT = "timeout"  # it waited past its bound: 503 (Anthropic: 504)


class RouterError(Exception):
    """A failure a client is told about. `code` is the machine-readable
    reason (`model_not_found`, `context_length_exceeded`, ...), `param` the
    request field at fault, `retry_after` seconds worth waiting, `details`
    extra fields some shapes carry (llama.cpp's n_prompt_tokens, n_ctx)."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None, kind: ErrorKind | None = None,
                 details: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.details = details or {}


class InvalidRequest(RouterError):
    kind = ErrorKind.INVALID


class NotFound(RouterError):
    kind = ErrorKind.NOT_FOUND


class Conflict(RouterError):
    kind = ErrorKind.CONFLICT


class Overloaded(RouterError):
    kind = ErrorKind.OVERLOADED


class Unavailable(RouterError):
    kind = ErrorKind.UNAVAILABLE


class QueueTimeout(RouterError):
    kind = ErrorKind.TIMEOUT


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus the output asked for) does not fit the context."""

    def __init__(self, message: str, *, n_prompt_tokens: int, n_ctx: int, param: str | None):
        super().__init__(message, code="context_length_exceeded", param=param,
                         details={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx})
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


def invalid(message: str, param: str | None, code: str = "invalid_value") -> InvalidRequest:
    """A 400 naming the request field at fault."""
    return InvalidRequest(message, code=code, param=param)


def model_not_found(name: str) -> NotFound:
    return NotFound(f"model '{name}' not found; GET /models lists the models",
                    code="model_not_found", param="model")
