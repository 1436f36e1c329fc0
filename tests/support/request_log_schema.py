"""The request log's schema (--request-log-jsonl): one JSON Schema per event
type, as data. docs/observability.md shows the same schemas; the tests check
every event the log writes against them (tests/support/json_schema.py). Only
tests read it: the router writes events and SCHEMA_VERSION, nothing more.

Objects are closed (additionalProperties: false) where we own every field,
so a field that could carry prompt or output text cannot slip in unnoticed.
"""

from __future__ import annotations

from typing import Any

from router.observability.request_log import SCHEMA_VERSION

_TS = {"type": "string", "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$",
       "description": "when the event happened: ISO 8601, UTC, milliseconds"}
_COUNT = {"type": "integer", "minimum": 0}
_SECONDS = {"type": "number", "minimum": 0}
_BYTES = {"type": "integer", "minimum": 0}
_RATE = {"type": "number", "minimum": 0, "description": "per second"}
_TEXT_OR_NULL = {"type": ["string", "null"]}


def _event(name: str, fields: dict[str, Any], description: str) -> dict[str, Any]:
    properties = {"ts": _TS, "event": {"const": name}, **fields}
    return {
        "description": description,
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _closed(fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": fields, "required": list(fields),
            "additionalProperties": False}


_REQUEST = {
    "request_id": {"type": "string", "pattern": "^req-",
                   "description": "the router's id of the request (unique); the response's "
                                  "x-request-id unless the client sent its own"},
    "client_request_id": {**_TEXT_OR_NULL,
                          "description": "the client's X-Request-Id, which the response "
                                         "echoed; null when it sent none or an invalid one"},
    "method": {"type": "string"},
    "route": {"type": "string", "description": "the path, without the query"},
    "api": {"enum": ["openai", "anthropic", "llamacpp"],
            "description": "whose error shape the route answers in"},
    "model": {**_TEXT_OR_NULL, "description": "the catalog id, once the request reached its model"},
    "key": {**_TEXT_OR_NULL, "description": "the API key's label (cli-1, env-1, file-NAME); never the key"},
}

_STAGES = _closed({
    "queue": {"type": ["number", "null"], "description": "arrival to admission"},
    "prefill": {"type": ["number", "null"], "description": "admission to the first token"},
    "decode": {"type": ["number", "null"], "description": "first to last token"},
    "total": {"type": ["number", "null"], "description": "arrival to the response's end"},
})

_TIERS = _closed({
    "device": {**_COUNT, "description": "whole pages found on the device"},
    "host": {**_COUNT, "description": "whole pages copied back from the host tier"},
    "disk": {**_COUNT, "description": "whole pages read back from the disk tier"},
    "partial": {**_COUNT, "description": "the leading tokens of one more page, reused to the token"},
})

_TOKENS = {
    "prompt_tokens": _COUNT,
    "cached_tokens": {**_COUNT, "description": "prompt tokens the prefix cache served"},
    "cached_by_tier": {**_TIERS, "description": "cached_tokens by the tier that served them"},
    "completion_tokens": _COUNT,
    "reasoning_tokens": {**_COUNT, "description": "completion tokens inside <think>...</think>"},
}

_FINISHED = {
    **_REQUEST,
    "status": {"type": "integer"},
    "engine_request_id": {**_TEXT_OR_NULL,
                          "description": "the id the client saw (chatcmpl-..., msg_...), once submitted"},
    **_TOKENS,
    "finish_reason": _TEXT_OR_NULL,
    "stages": _STAGES,
}

_MODEL_THROUGHPUT = _closed({
    "model": {"type": "string"},
    "prompt_tokens": {**_COUNT, "description": "prompt tokens admitted in the interval"},
    "cached_tokens": {**_COUNT, "description": "of those, served by the prefix cache"},
    "generated_tokens": _COUNT,
    "prompt_tokens_per_second": _RATE,
    "cached_tokens_per_second": _RATE,
    "generated_tokens_per_second": _RATE,
    "running": _COUNT,
    "prefilling": _COUNT,
    "waiting": {**_COUNT, "description": "in the engine, not yet scheduled"},
    "queued": {**_COUNT, "description": "held by the router until a lane frees"},
    "kv_pages_used": _COUNT,
    "kv_pages_total": _COUNT,
})

EVENT_SCHEMAS: dict[str, dict[str, Any]] = {
    "server_start": _event("server_start", {
        "schema_version": {"const": SCHEMA_VERSION},
        "version": {"type": "string"},
        "pid": _COUNT,
        "argv": {"type": "array", "items": {"type": "string"},
                 "description": "the command line; --api-key values read <redacted>"},
        "options": {
            "type": "object",
            "description": "the resolved router options (ServeConfig); API keys only counted",
            "properties": {"api_keys": _COUNT, "api_keys_env": _COUNT},
            "required": ["api_keys", "api_keys_env"],
        },
        "catalog": {"type": "array", "items": _closed({
            "id": {"type": "string"},
            "path": {"type": "string"},
            "format": {"enum": ["gguf", "hf"]},
            "aliases": {"type": "array", "items": {"type": "string"}},
            "settings": {"type": "object", "description": "the resolved ModelSettings"},
        })},
        "memory": _closed({"host_total_bytes": _BYTES, "host_available_bytes": _BYTES}),
    }, "the router started: what it runs and with what"),
    "server_stop": _event("server_stop", {
        "exit_status": {"type": "integer"},
        "events_dropped": {**_COUNT, "description": "events this run could not write"},
    }, "the router is exiting; the last event of a run"),
    "model_loaded": _event("model_loaded", {
        "model": {"type": "string"},
        "pid": _COUNT,
        "seconds": {**_SECONDS, "description": "the whole load, as the router saw it"},
        "engine_load_seconds": _SECONDS,
        "device": {"type": "string"},
        "dtype": {"type": "string"},
        "n_params": _COUNT,
        "weights_bytes": _BYTES,
        "context": {**_COUNT, "description": "tokens one request may hold"},
        "kv": _closed({
            "page_size": _COUNT,
            "pages": _COUNT,
            "tokens": _COUNT,
            "bytes": _BYTES,
            "bytes_per_token": _BYTES,
            "lanes": {**_COUNT, "description": "requests decoded together"},
        }),
        "memory": _closed({"host_available_bytes": _BYTES}),
    }, "a model's engine is ready: its memory ledger"),
    "model_event": _event("model_event", {
        "model": {"type": "string"},
        "kind": {"enum": ["wake", "sleep", "unload", "fail"]},
        "seconds": {**_SECONDS, "description": "how long the transition took (0: not measured)"},
    }, "another lifecycle transition of a model"),
    "model_evicted": _event("model_evicted", {
        "model": {"type": "string"},
        "action": {"enum": ["sleep", "unload"]},
        "reason": {"enum": ["device_memory", "models_max"],
                   "description": "what was short: a GPU's memory, or seats under --models-max"},
        "for_model": {"type": "string", "description": "the model the room was made for"},
        "device": {**_TEXT_OR_NULL, "description": "the evicted model's device (cuda:N, cpu)"},
    }, "a model was put to sleep or unloaded to make room for another"),
    "request_start": _event("request_start", {
        **_REQUEST,
        "queue_seconds": {**_SECONDS, "description": "arrival to admission (a load or wake waits here)"},
    }, "the request got its model and starts running (requests that need no engine have none)"),
    "request_done": _event("request_done", _FINISHED, "the request ended normally (status < 400)"),
    "request_rejected": _event("request_rejected", {
        **_REQUEST,
        "status": {"type": "integer"},
        "error_code": _TEXT_OR_NULL,
        "stages": _STAGES,
    }, "refused before it ran: a 4xx, or a 503/429 for overload or shutdown"),
    "request_error": _event("request_error", {**_FINISHED, "error_code": _TEXT_OR_NULL},
                            "a server-side failure: a 5xx, an engine that failed"),
    "request_cancelled": _event("request_cancelled", _FINISHED,
                                "the client went away before the end; status is 499"),
    "throughput": _event("throughput", {
        "interval_seconds": _SECONDS,
        "models": {"type": "array", "items": _MODEL_THROUGHPUT},
    }, "every --log-stats-interval-ms while a model is loaded: tokens since the last one"),
    "events_dropped": _event("events_dropped", {
        "count": {**_COUNT, "description": "events lost since the last report"},
        "total": _COUNT,
    }, "the writer fell behind or could not write; written before the next event that fits"),
}

REQUEST_EVENTS = ("request_start", "request_done", "request_rejected", "request_error",
                  "request_cancelled")
