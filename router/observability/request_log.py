"""The request log (--request-log-jsonl): one JSON object per line per event,
for whoever reads a server's history later (billing, capacity planning, an
incident). docs/observability.md lists the events and their schemas (kept
as data in tests/support/request_log_schema.py, which the tests hold every
event to).

Events carry counts, codes, ids and times, never prompt or output text. They
are encoded here, on the event loop (a few microseconds), and written by the
JsonlWriter's thread.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import psutil

from router.catalog import Catalog
from router.config import ServeConfig
from router.observability.jsonl_writer import QUEUE_LINES, JsonlWriter
from router.observability.outcome import final_outcome
from router.observability.records import RequestRecord
from router.observability.throughput import ModelThroughput

if TYPE_CHECKING:
    from router.lifecycle import ModelManager

REDACTED = "<redacted>"
# In server_start; changes when a field changes meaning or goes away. The
# schema itself (tests/support/request_log_schema.py) is the tests' and the
# docs': the router only writes the events.
SCHEMA_VERSION = 1
# ServeConfig fields that hold secrets; the log says how many there are.
SECRET_OPTIONS = ("api_keys", "api_keys_env")

_encode = msgspec.json.Encoder().encode


def iso_now(now: float | None = None) -> str:
    """ISO 8601 in UTC with milliseconds: 2026-11-29T20:27:32.123Z."""
    now = time.time() if now is None else now
    millis = int(now * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{millis:03d}Z"


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line with every --api-key value replaced."""
    redacted: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next:
            redacted.append(REDACTED)
            hide_next = False
        elif word == "--api-key":
            redacted.append(word)
            hide_next = True
        elif word.startswith("--api-key="):
            redacted.append("--api-key=" + REDACTED)
        else:
            redacted.append(word)
    return redacted


def _builtins(value: Any) -> Any:
    """Dataclasses, Structs, Paths and tuples as plain JSON values."""
    return msgspec.to_builtins(value, enc_hook=str)


def options_without_secrets(config: ServeConfig) -> dict[str, Any]:
    options = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    for name in SECRET_OPTIONS:
        options[name] = len(options[name])
    return _builtins(options)


def catalog_entries(catalog: Catalog) -> list[dict[str, Any]]:
    return [{"id": entry.id, "path": str(entry.path), "format": entry.format,
             "aliases": list(entry.settings.aliases), "settings": _builtins(entry.settings)}
            for entry in catalog.entries.values()]


def _version() -> str:
    try:
        return metadata.version("roundhouse")
    except metadata.PackageNotFoundError:
        return "unknown"


def _stages(record: RequestRecord) -> dict[str, float | None]:
    return {name: None if seconds is None else round(seconds, 6)
            for name, seconds in record.stage_seconds().items()}


class RequestLog:
    """Writes the events; a RequestObserver and a ModelObserver."""

    def __init__(self, path: Path, max_bytes: int, keep: int, *, queue_lines: int = QUEUE_LINES):
        self.writer = JsonlWriter(path, max_bytes, keep, queue_lines=queue_lines,
                                  dropped_line=self._dropped_line)
        self._manager: ModelManager | None = None
        self._started: set[str] = set()

    def attach(self, manager: ModelManager) -> None:
        """The manager whose slots hold each loaded model's Ready facts."""
        self._manager = manager

    def emit(self, event: str, fields: dict[str, Any]) -> None:
        self.writer.write(self._line(event, fields))

    @staticmethod
    def _line(event: str, fields: dict[str, Any]) -> bytes:
        return _encode({"ts": iso_now(), "event": event, **fields}) + b"\n"

    def _dropped_line(self, count: int, total: int) -> bytes:
        return self._line("events_dropped", {"count": count, "total": total})

    # ---- the server -----------------------------------------------------------------

    def server_started(self, config: ServeConfig, catalog: Catalog, argv: Sequence[str]) -> None:
        memory = psutil.virtual_memory()
        self.emit("server_start", {
            "schema_version": SCHEMA_VERSION,
            "version": _version(),
            "pid": os.getpid(),
            "argv": redact_argv(argv),
            "options": options_without_secrets(config),
            "catalog": catalog_entries(catalog),
            "memory": {"host_total_bytes": memory.total, "host_available_bytes": memory.available},
        })

    def throughput(self, sample: list[ModelThroughput]) -> None:
        seconds = max((entry.seconds for entry in sample), default=0.0)
        self.emit("throughput", {"interval_seconds": round(seconds, 3),
                                 "models": [entry.as_event() for entry in sample]})

    def close(self, exit_status: int) -> None:
        """The last event, then flush and close (blocks up to a few seconds)."""
        self.writer.close(self._line("server_stop", {"exit_status": exit_status,
                                                     "events_dropped": self.writer.dropped}))

    # ---- models (ModelObserver) ---------------------------------------------------------

    def model_evicted(self, model: str, action: str, reason: str, for_model: str,
                      device: str | None) -> None:
        self.emit("model_evicted", {"model": model, "action": action, "reason": reason,
                                    "for_model": for_model, "device": device})

    def model_event(self, model: str, kind: str, seconds: float) -> None:
        if kind != "load":
            self.emit("model_event", {"model": model, "kind": kind, "seconds": round(seconds, 3)})
            return
        slot = self._manager.slots.get(model) if self._manager is not None else None
        ready = slot.ready if slot is not None else None
        if ready is None:
            return
        kv = ready.kv
        self.emit("model_loaded", {
            "model": model,
            "pid": ready.pid,
            "seconds": round(seconds, 3),
            "engine_load_seconds": round(ready.load_seconds, 3),
            "device": ready.model.device,
            "dtype": ready.model.dtype,
            "n_params": ready.model.n_params,
            "weights_bytes": ready.model.size_bytes,
            "context": kv.max_context,
            "kv": {"page_size": kv.page_size, "pages": kv.num_pages, "tokens": kv.capacity_tokens,
                   "bytes": kv.capacity_tokens * kv.bytes_per_token,
                   "bytes_per_token": kv.bytes_per_token, "lanes": kv.max_concurrency},
            "memory": {"host_available_bytes": psutil.virtual_memory().available},
        })

    # ---- requests (RequestObserver) -------------------------------------------------------

    def request_started(self, record: RequestRecord) -> None:
        pass  # its model is not known yet: request_start waits for admission

    def request_admitted(self, record: RequestRecord) -> None:
        if record.id in self._started:
            return
        self._started.add(record.id)
        queued = (record.admitted or record.arrived) - record.arrived
        self.emit("request_start", {**self._request(record), "queue_seconds": round(queued, 6)})

    def tokens_generated(self, record: RequestRecord, count: int, now: float) -> None:
        pass

    def request_finished(self, record: RequestRecord) -> None:
        self._started.discard(record.id)
        outcome = final_outcome(record)
        fields = self._request(record)
        # The observe middleware always sets a status; 500 if it could not.
        fields["status"] = record.status if record.status is not None else 500
        if outcome == "rejected":
            self.emit("request_rejected", {**fields, "error_code": record.error_code,
                                           "stages": _stages(record)})
            return
        fields.update(
            engine_request_id=record.engine_request_id,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            cached_by_tier=record.cached_by_tier,
            completion_tokens=record.completion_tokens,
            reasoning_tokens=record.reasoning_tokens,
            finish_reason=record.finish_reason,
            stages=_stages(record),
        )
        if outcome == "error":
            self.emit("request_error", {**fields, "error_code": record.error_code})
        elif outcome == "cancelled":
            self.emit("request_cancelled", fields)
        else:
            self.emit("request_done", fields)

    @staticmethod
    def _request(record: RequestRecord) -> dict[str, Any]:
        return {"request_id": record.id, "client_request_id": record.client_request_id,
                "method": record.method, "route": record.route,
                "api": record.api, "model": record.model, "key": record.key_label}
