"""The operational log's request and throughput lines (stderr):

    request req-1a2b POST /v1/chat/completions model=qwen3 key=cli-1 started
    request req-1a2b POST /v1/chat/completions model=qwen3 key=cli-1 done 200 in 1.23s: 37 prompt (32 cached) + 12 generated tokens, stop
    request req-3c4d POST /v1/chat/completions rejected 400 invalid_json in 0.00s
    request req-5e6f POST /v1/messages model=qwen3 error 503 engine_failed in 0.52s: 37 prompt + 3 generated tokens
    throughput qwen3: prompt 812.4 tok/s (75% cached), generated 96.0 tok/s, running 3, waiting 0, queued 0, KV 12% (123/1024 pages)

Counts and codes only: never a word of a prompt or an output.
"""

from __future__ import annotations

import logging

from router.observability.outcome import final_outcome
from router.observability.records import RequestRecord
from router.observability.throughput import ModelThroughput

log = logging.getLogger("router.requests")


def _who(record: RequestRecord) -> str:
    text = f"request {record.id} {record.method} {record.route}"
    if record.model is not None:
        text += f" model={record.model}"
    if record.key_label is not None:
        text += f" key={record.key_label}"
    return text


def _tiers(record: RequestRecord) -> str:
    """': 16 device + 8 partial', the tiers that served cached tokens."""
    served = [f"{count} {tier}" for tier, count in record.cached_by_tier.items() if count]
    return ": " + " + ".join(served) if served else ""


def _tokens(record: RequestRecord) -> str:
    """': 37 prompt (32 cached) + 12 generated tokens', or '' for a request
    that never reached an engine (token counting, model operations)."""
    if not (record.prompt_tokens or record.completion_tokens or record.engine_request_id):
        return ""
    cached = f" ({record.cached_tokens} cached{_tiers(record)})" if record.cached_tokens else ""
    reasoning = f" ({record.reasoning_tokens} reasoning)" if record.reasoning_tokens else ""
    plural = "" if record.completion_tokens == 1 else "s"
    return (f": {record.prompt_tokens} prompt{cached} + {record.completion_tokens} "
            f"generated token{plural}{reasoning}")


def _seconds(record: RequestRecord) -> float:
    total = record.stage_seconds()["total"]
    return total if total is not None else 0.0


class RequestLogLines:
    """A RequestObserver that writes one line when a request starts on its
    model and one when it ends."""

    def __init__(self) -> None:
        # A request is admitted once; the set makes sure it is said once.
        self._started: set[str] = set()

    def request_started(self, record: RequestRecord) -> None:
        pass  # its model is not known yet: the line waits for admission

    def request_admitted(self, record: RequestRecord) -> None:
        if record.id not in self._started:
            self._started.add(record.id)
            log.info("%s started", _who(record))

    def tokens_generated(self, record: RequestRecord, count: int, now: float) -> None:
        pass

    def request_finished(self, record: RequestRecord) -> None:
        self._started.discard(record.id)
        outcome = final_outcome(record)
        who, took, tokens = _who(record), _seconds(record), _tokens(record)
        if outcome == "ok":
            reason = f", {record.finish_reason}" if record.finish_reason else ""
            log.info("%s done %s in %.2fs%s%s", who, record.status, took, tokens, reason)
        elif outcome == "cancelled":
            log.info("%s cancelled by the client after %.2fs%s", who, took, tokens)
        elif outcome == "rejected":
            log.info("%s rejected %s %s in %.2fs", who, record.status, record.error_code or "-", took)
        else:
            # A failure on our side: it stays visible at --log-level warning.
            log.warning("%s error %s %s in %.2fs%s", who, record.status, record.error_code or "-",
                        took, tokens)


class ThroughputLines:
    """The periodic throughput line, one per loaded model. A model idle now
    and in the interval before is reported at DEBUG, so an idle server does
    not fill its log; the first idle line after work is still INFO."""

    def __init__(self) -> None:
        self._busy_before: set[str] = set()

    def __call__(self, sample: list[ModelThroughput]) -> None:
        busy_now = {entry.model for entry in sample if entry.busy}
        for entry in sample:
            level = logging.INFO if entry.model in busy_now | self._busy_before else logging.DEBUG
            log.log(level, "%s", throughput_line(entry))
        self._busy_before = busy_now


def throughput_line(entry: ModelThroughput) -> str:
    cached = ""
    if entry.prompt_tokens:
        cached = f" ({100 * entry.cached_tokens / entry.prompt_tokens:.0f}% cached)"
    kv = entry.kv_pages_used / entry.kv_pages_total if entry.kv_pages_total else 0.0
    return (f"throughput {entry.model}: prompt {entry.per_second(entry.prompt_tokens):.1f} tok/s"
            f"{cached}, generated {entry.per_second(entry.generated_tokens):.1f} tok/s, "
            f"running {entry.running}, waiting {entry.waiting}, queued {entry.queued}, "
            f"KV {100 * kv:.0f}% ({entry.kv_pages_used}/{entry.kv_pages_total} pages)")
