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

from router.errors import ErrorKind, RouterError, invalid
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
    body: dict[str, Any] = {"code": error.status, "message": error.message, "type": error.type}
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


def error_response(error: ApiError, shape: Api = Api.OPENAI) -> web.Response:
    if shape is Api.ANTHROPIC:
        request_id = new_anthropic_request_id()
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
    return error_response(error, shape)


def _param_from_path(path: str) -> str | None:
    """msgspec reports `$.messages[0].role`; clients want `messages[0].role`."""
    return path.removeprefix("$").removeprefix(".") or None


def decode_body(raw: bytes, struct: type) -> Any:
    """Parse a JSON request body into a typed Struct, or raise a 400 naming the field."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return msgspec.json.decode(raw, type=struct)
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
