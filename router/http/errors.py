"""The one place where errors become responses.

Domain code raises router.errors.RouterError (a kind, a code, a param); HTTP
handlers may raise ApiError, a RouterError with an explicit status. The
middleware maps either to a status and renders it in the error shape of the
API the matched route belongs to (router/http/routes.py says which: OpenAI,
Anthropic or llama.cpp); only a path that matched no route has its shape
guessed from the path. Anything else becomes a logged 500 and the server
keeps going.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from router.engine_client import EngineFailure
from router.errors import ErrorKind, RouterError, invalid
from router.http.json_bounds import (
    INT_MAX,
    INT_MIN,
    MAX_JSON_DEPTH,
    nested_too_deeply,
    out_of_range_int,
)
from router.http.route_info import Api, api_of

log = logging.getLogger(__name__)


class ApiError(RouterError):
    """An error with its HTTP status decided: raised by HTTP handlers, and
    what every RouterError becomes (api_error) before it is rendered."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
    ):
        super().__init__(message, code=code, param=param, details=details)
        self.status = status
        self.type = type or default_type(status)
        self.headers = headers or {}


_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.NOT_ALLOWED: 405,
    ErrorKind.CONFLICT: 409,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.TIMEOUT: 503,
}


def api_error(error: RouterError) -> ApiError:
    """A domain error with its status: the one mapping from kinds to HTTP."""
    if isinstance(error, ApiError):
        return error
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(error.retry_after)))
    return ApiError(_STATUS[error.kind], error.message, code=error.code, param=error.param,
                    headers=headers, details=error.details)


def default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_status(error: ApiError) -> int:
    """Anthropic says "overloaded" with 529 where we say 503 or refuse a full
    queue with 429, and "timeout" with 504 where a request waited too long."""
    if error.code == "request_queue_timeout":
        return 504
    if error.status == 503 or error.code == "server_overloaded":
        return 529
    return error.status


def anthropic_error_body(error: ApiError, request_id: str) -> dict[str, Any]:
    status = anthropic_status(error)
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}, "request_id": request_id}


def new_anthropic_request_id() -> str:
    return "req_" + uuid.uuid4().hex[:24]


def llamacpp_error_body(error: ApiError) -> dict[str, Any]:
    """llama.cpp's shape: the HTTP status as `code`; like llama.cpp's own
    specific errors (which add n_ctx and friends) ours add a `reason`."""
    kind = error.type
    if error.code == "context_length_exceeded":
        # llama.cpp's own name for it, with n_prompt_tokens and n_ctx beside.
        kind = "exceed_context_size_error"
    body: dict[str, Any] = {"code": error.status, "message": error.message, "type": kind}
    if error.code:
        body["reason"] = error.code
    body.update(error.details)
    return {"error": body}


def openai_error_body(error: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def error_response(error: ApiError, shape: Api = Api.OPENAI,
                   request_id: str | None = None) -> web.Response:
    if shape is Api.ANTHROPIC:
        request_id = request_id or new_anthropic_request_id()
        return web.json_response(anthropic_error_body(error, request_id),
                                 status=anthropic_status(error),
                                 headers={**error.headers, "request-id": request_id})
    body = openai_error_body(error) if shape is Api.OPENAI else llamacpp_error_body(error)
    return web.json_response(body, status=error.status, headers=error.headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    shape = api_of(request)
    try:
        return await handler(request)
    except RouterError as domain_error:
        error = api_error(domain_error)
        if error.status >= 500:
            # Polls during a single model's start-up are expected, not news.
            level = logging.DEBUG if error.code == "model_loading" else logging.WARNING
            log.log(level, "%s %s -> %d %s: %s", request.method, request.path, error.status,
                    error.code, error.message)
        return _render(request, error, shape)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own errors (unknown route, wrong method, a body over
        # --max-request-mib) in the API's shape.
        code = "request_too_large" if exc.status == 413 else exc.reason.lower().replace(" ", "_")
        return _render(request, ApiError(exc.status, exc.reason, code=code), shape)
    except RequestPayloadError as exc:
        # Reading the body failed in aiohttp: above all, one sent with
        # Content-Encoding: gzip or deflate that does not decompress. The rest
        # of it cannot be read either: answer, then close the connection, and
        # mark the body ended so that aiohttp does not try to drain it first
        # (it would log the same failure as an unhandled exception).
        response = _render(request, unreadable_body(request, exc), shape)
        response.force_close()
        request.content.feed_eof()
        return response
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        error = ApiError(500, "internal server error; see the server log", code="internal_error")
        return _render(request, error, shape)


def _render(request: web.Request, error: ApiError, shape: Api) -> web.Response:
    # The request's record (router/http/observe.py) learns why it failed.
    from router.observability.records import RECORD

    record = request.get(RECORD)
    if record is not None:
        record.error_code = error.code
    # The body's request_id is the one the headers carry (router/http/request_id.py).
    from router.http.request_id import request_id_of

    return error_response(error, shape, request_id_of(request))


def _param_from_path(path: str) -> str | None:
    """msgspec reports `$.messages[0].role`; clients want `messages[0].role`."""
    return path.removeprefix("$").removeprefix(".") or None


def decode_body(raw: bytes, struct: type) -> Any:
    """Parse a JSON request body into a typed Struct, or raise a 400 naming the field.

    Beyond the types: nesting deeper than MAX_JSON_DEPTH and integers outside
    64 bits are refused too (router/http/json_bounds.py says why)."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = msgspec.json.decode(raw, type=struct)
    except RecursionError:
        # msgspec gives up at the interpreter's recursion limit, far past ours.
        raise _too_deep() from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        message, _, path = text.partition(" - at `")
        param = _param_from_path(path.rstrip("`")) if path else None
        if message.startswith("Object missing required field"):
            field = message.split("`")[1]
            param = f"{param}.{field}" if param else field
            raise invalid(f"missing required parameter '{param}'", param, "missing_required_parameter") from None
        raise invalid(f"invalid type for '{param}': {message}", param, "invalid_type") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if nested_too_deeply(raw):
        raise _too_deep()
    big = out_of_range_int(raw, body)
    if big is not None:
        path, value = big
        raise invalid(f"'{path}' holds {value}, outside what a 64-bit integer holds "
                      f"({INT_MIN}..{INT_MAX})", path)
    return body


def unreadable_body(request: web.Request, exc: RequestPayloadError) -> ApiError:
    encoding = request.headers.get("Content-Encoding")
    said = f" (sent with Content-Encoding: {encoding})" if encoding else ""
    cause = exc.__cause__ or exc
    # aiohttp's errors read "400, message: ..."; their message alone says it.
    reason = str(getattr(cause, "message", cause)).strip()
    return ApiError(400, f"the request body could not be read{said}: {reason}", code="invalid_body")


def _too_deep() -> ApiError:
    return ApiError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} "
                    "levels deep", code="invalid_json")


def engine_error(exc: EngineFailure) -> ApiError:
    """What an engine's refusal or death (router/engine_client.py) says: a refusal
    is the client's 400, a dead engine a 503, a request ended by the shutdown
    a 503 shutting_down."""
    if exc.code == "context_length_exceeded":
        return ApiError(400, str(exc), code="context_length_exceeded", param="messages")
    if exc.code == "invalid_grammar":
        # The engine's xgrammar refused the constraint (bad GBNF, regex or schema).
        return api_error(invalid(str(exc), "grammar", "invalid_grammar"))
    if exc.code in ("invalid_request", "duplicate_request"):
        return api_error(invalid(str(exc), None, exc.code))
    if exc.code == "shutting_down":
        return ApiError(503, str(exc), code="shutting_down", headers={"Retry-After": "5"})
    return ApiError(503, str(exc), code="engine_failed", headers={"Retry-After": "1"})


def as_api_error(exc: Exception) -> ApiError:
    """What an error raised while a stream is open says in its error event."""
    if isinstance(exc, RouterError):
        return api_error(exc)
    if isinstance(exc, EngineFailure):
        return engine_error(exc)
    return ApiError(500, "internal error", type="server_error")
