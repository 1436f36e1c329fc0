"""Which final event a request gets; the request log and the log lines agree."""

from __future__ import annotations

from router.observability.records import RequestRecord

# 503s the observe middleware counts as refusals (overload, shutdown) that are
# really failures on our side: the engine died, or the model could not load.
SERVER_FAILURES = frozenset({"engine_failed", "model_load_failed", "internal_error"})


def final_outcome(record: RequestRecord) -> str:
    """"ok", "rejected", "error" or "cancelled"."""
    outcome = record.outcome
    if outcome is None:
        status = record.status or 500
        outcome = "ok" if status < 400 else "rejected" if status < 500 else "error"
    if outcome == "rejected" and record.error_code in SERVER_FAILURES:
        return "error"
    return outcome
