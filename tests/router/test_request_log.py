"""The request log (JSONL) and the operational log's lines: rotation, drops,
redaction, every event against its schema, and no prompt text anywhere."""

from __future__ import annotations

import asyncio
import calendar
import io
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from protocol import CacheHits, EngineStats, KvFacts, ModelFacts, Ready
from router.catalog import Catalog, CatalogEntry, build_catalog
from router.config import ServeConfig
from router.lifecycle.slot import ModelState
from router.observability.jsonl_writer import JsonlWriter
from router.observability.log_lines import RequestLogLines, ThroughputLines
from router.observability.logging_setup import LINE_PATTERN, line_formatter
from router.observability.records import RequestRecord
from router.observability.request_log import RequestLog, redact_argv
from router.observability.throughput import ModelThroughput, ThroughputMeter
from tests.support.json_schema import errors
from tests.support.request_log_schema import EVENT_SCHEMAS
from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import free_port

ROOT = Path(__file__).resolve().parents[2]
MARKER = "quetzalcoatl7"


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def schema_errors(event: dict[str, Any]) -> list[str]:
    schema = EVENT_SCHEMAS.get(event.get("event", ""))
    if schema is None:
        return [f"unknown event {event.get('event')!r}"]
    return errors(event, schema)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@contextmanager
def stalled(writer: JsonlWriter) -> Iterator[None]:
    """Hold the writer thread inside its next write, as a stalled disk would."""
    entered, release = threading.Event(), threading.Event()
    original = writer._write_lines

    def slow(lines: list[bytes]) -> None:
        entered.set()
        release.wait(5)
        original(lines)

    writer._write_lines = slow  # type: ignore[method-assign]
    writer.write(b'{"n": "stall"}\n')
    assert entered.wait(5)
    try:
        yield
    finally:
        writer._write_lines = original  # type: ignore[method-assign]
        release.set()


def finished(outcome: str, status: int, *, model: str | None = "qwen3", code: str | None = None,
             **fields: Any) -> RequestRecord:
    record = RequestRecord(method="POST", route="/v1/chat/completions", api="openai",
                           key_label="cli-1")
    record.model = model
    if model is not None:
        record.admitted = record.arrived + 0.25
    for name, value in fields.items():
        setattr(record, name, value)
    record.finished = record.arrived + 1.5
    record.status, record.outcome, record.error_code = status, outcome, code
    return record


def generated(outcome: str = "ok", status: int = 200, **fields: Any) -> RequestRecord:
    record = finished(outcome, status, **fields)
    record.engine_request_id = "chatcmpl-1"
    record.prompt_tokens, record.cached_tokens = 37, 32
    record.report_cache_hits(CacheHits(device=16, host=8, partial=8))
    record.completion_tokens, record.reasoning_tokens = 12, 5
    record.first_token, record.last_token = record.arrived + 0.5, record.arrived + 1.25
    record.finish_reason = fields.get("finish_reason", "stop")
    return record


# ---- the writer: rotation and drops ---------------------------------------------------


def test_rotation_by_size_keeps_the_newest_files(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b'{"n": -1}\n')  # a restarted server appends, and counts what is there
    writer = JsonlWriter(path, max_bytes=100, keep=2)
    lines = [json.dumps({"n": n}).encode() + b"\n" for n in range(60)]  # 10 or 11 bytes each
    for line in lines:
        writer.write(line)
    writer.close()
    files = [path.with_name(f"requests.jsonl.{n}") for n in (2, 1)] + [path]
    assert not path.with_name("requests.jsonl.3").exists()
    assert all(0 < f.stat().st_size <= 100 for f in files)
    kept = [json.loads(line)["n"] for f in files for line in f.read_text().splitlines()]
    # The oldest fell off; what is kept is the newest events, in order, each whole.
    assert kept == list(range(60))[-len(kept):]
    assert 18 <= len(kept) <= 30


def test_a_full_queue_drops_events_and_reports_how_many(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "r.jsonl", 1 << 20, 2, queue_lines=2)
    with stalled(log.writer):
        for number in range(5):
            log.emit("model_event", {"model": f"m{number}", "kind": "wake", "seconds": 0.0})
        assert log.writer.dropped_full == 3
    log.close(0)
    events = read_events(tmp_path / "r.jsonl")
    # The report goes before the first line written after the drops.
    assert [e.get("event") for e in events] == [
        "events_dropped", None, "model_event", "model_event", "server_stop"]
    assert events[0]["count"] == 3 and events[0]["total"] == 3
    assert [e["model"] for e in events[2:4]] == ["m0", "m1"]
    assert events[-1]["events_dropped"] == 3


def test_failed_writes_are_counted_and_reported(tmp_path: Path) -> None:
    class FullDisk:
        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    log = RequestLog(tmp_path / "r.jsonl", 1 << 20, 2)
    with stalled(log.writer):
        log.writer._file = FullDisk()  # type: ignore[assignment]
        log.emit("model_event", {"model": "lost", "kind": "wake", "seconds": 0.0})
    wait_for(lambda: log.writer.dropped_failed == 2, "the failed writes")  # the stall line too
    log.writer._file = None  # the disk has room again: the writer reopens the file
    log.emit("model_event", {"model": "kept", "kind": "wake", "seconds": 0.0})
    log.close(0)
    events = read_events(tmp_path / "r.jsonl")
    assert [e["event"] for e in events] == ["events_dropped", "model_event", "server_stop"]
    assert events[0]["count"] == 2 and events[1]["model"] == "kept"


def test_an_unwritable_path_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        RequestLog(tmp_path / "missing-dir" / "r.jsonl", 1 << 20, 2)


# ---- what the events say ----------------------------------------------------------------


def test_api_keys_are_redacted_from_argv() -> None:
    argv = ["roundhouse", "serve", "--api-key", "sk-one", "--api-key=sk-two",
            "--api-key-file", "/etc/keys", "--port", "8080", "--api-key"]
    assert redact_argv(argv) == ["roundhouse", "serve", "--api-key", "<redacted>",
                                 "--api-key=<redacted>", "--api-key-file", "/etc/keys",
                                 "--port", "8080", "--api-key"]


def test_server_start_counts_keys_and_describes_the_catalog(tmp_path: Path) -> None:
    config = ServeConfig(models_dir=Path("/models"), api_keys=("sk-one", "sk-two"),
                         api_keys_env=("sk-env",), request_log_jsonl=tmp_path / "r.jsonl")
    catalog = Catalog({"qwen3": CatalogEntry("qwen3", Path("/models/qwen3"), "hf")})
    log = RequestLog(tmp_path / "r.jsonl", 1 << 20, 2)
    log.server_started(config, catalog, ["roundhouse", "serve", "--api-key", "sk-one",
                                         "--api-key=sk-two"])
    log.close(0)
    text = (tmp_path / "r.jsonl").read_text()
    assert "sk-one" not in text and "sk-two" not in text and "sk-env" not in text
    start = read_events(tmp_path / "r.jsonl")[0]
    assert schema_errors(start) == []
    assert start["options"]["api_keys"] == 2 and start["options"]["api_keys_env"] == 1
    assert start["options"]["models_dir"] == "/models"
    (entry,) = start["catalog"]
    assert entry["id"] == "qwen3" and entry["settings"]["engine"]["page_size"] == 16
    assert start["memory"]["host_total_bytes"] >= start["memory"]["host_available_bytes"] > 0


def fake_manager() -> SimpleNamespace:
    facts = ModelFacts("Qwen3ForCausalLM", 151936, 40960, 1024, 28, 16, 8, 596_000_000,
                       1_192_000_000, "bfloat16", "cuda:0")
    ready = Ready(3, 4242, facts, KvFacts(16, 2048, 8192, 8, 512, 114688), 2.5)
    return SimpleNamespace(slots={"qwen3": SimpleNamespace(ready=ready)})


def every_event(path: Path) -> list[dict[str, Any]]:
    """Drive one RequestLog through every kind of event it writes."""
    config = ServeConfig(model=Path("/models/qwen3.gguf"))
    log = RequestLog(path, 1 << 20, 2)
    log.attach(fake_manager())  # type: ignore[arg-type]
    log.server_started(config, Catalog({"qwen3": CatalogEntry("qwen3", Path("/m"), "gguf")}),
                       ["roundhouse", "serve"])
    log.model_event("qwen3", "load", 3.2)
    log.model_event("qwen3", "sleep", 0.4)
    log.model_evicted("qwen3", "unload", "device_memory", "llama", "cuda:0")
    ok = generated()
    log.request_started(ok)
    log.request_admitted(ok)
    log.request_admitted(ok)  # said once
    log.request_finished(ok)
    log.request_finished(finished("rejected", 400, model=None, code="invalid_json"))
    log.request_finished(finished("rejected", 429, code="server_overloaded"))
    # The observe middleware counts every 503 as a refusal; an engine that
    # died is a failure all the same.
    log.request_finished(generated("rejected", 503, code="engine_failed"))
    log.request_finished(finished("error", 500, code="internal_error"))
    log.request_finished(generated("cancelled", 499, finish_reason=None))
    log.throughput([ModelThroughput("qwen3", 10.0, 800, 600, 96, 3, 1, 0, 4, 123, 1024)])
    wait_for(lambda: log.writer._queue.qsize() == 0, "the writer to catch up")
    log.writer.queue_lines = 1
    with stalled(log.writer):
        log.request_finished(generated())
        log.request_finished(generated())  # the queue holds one: dropped
    log.close(0)
    return [event for event in read_events(path) if event.get("n") != "stall"]


def test_every_event_type_matches_its_schema(tmp_path: Path) -> None:
    events = every_event(tmp_path / "r.jsonl")
    assert {e["event"] for e in events} == set(EVENT_SCHEMAS)
    for event in events:
        assert schema_errors(event) == [], event
    kinds = [e["event"] for e in events]
    assert kinds.count("request_start") == 1
    assert kinds.count("request_rejected") == 2 and kinds.count("request_error") == 2
    loaded = next(e for e in events if e["event"] == "model_loaded")
    assert loaded["kv"] == {"page_size": 16, "pages": 2048, "tokens": 32768,
                            "bytes": 32768 * 114688, "bytes_per_token": 114688, "lanes": 8}
    assert loaded["weights_bytes"] == 1_192_000_000 and loaded["context"] == 8192
    done = next(e for e in events if e["event"] == "request_done")
    assert done["stages"] == {"queue": 0.25, "prefill": 0.25, "decode": 0.75, "total": 1.5}
    assert (done["prompt_tokens"], done["cached_tokens"], done["completion_tokens"],
            done["reasoning_tokens"]) == (37, 32, 12, 5)
    assert done["cached_by_tier"] == {"device": 16, "host": 8, "disk": 0, "partial": 8}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", done["ts"])


def test_the_schema_check_catches_broken_events(tmp_path: Path) -> None:
    done = next(e for e in every_event(tmp_path / "r.jsonl") if e["event"] == "request_done")
    assert schema_errors({**done, "prompt": "some text"})  # a field nobody declared
    assert schema_errors({k: v for k, v in done.items() if k != "key"})
    assert schema_errors({**done, "prompt_tokens": "37"})
    assert schema_errors({**done, "prompt_tokens": True})
    assert schema_errors({**done, "ts": "2026-11-29 20:00:00"})
    assert schema_errors({**done, "stages": {**done["stages"], "queue": "fast"}})
    assert schema_errors({**done, "event": "request_finished"})


def test_the_docs_show_the_schemas_the_code_holds() -> None:
    text = (ROOT / "docs" / "observability.md").read_text()
    shown = {}
    for name, block in re.findall(r"### `(\w+)`\n.*?```json\n(.*?)```", text, re.S):
        shown[name] = json.loads(block)
    assert shown == EVENT_SCHEMAS


# ---- the operational log --------------------------------------------------------------


def test_log_lines_have_the_documented_format() -> None:
    # configure_logging() gives the root logger this formatter; the e2e tests
    # read a real server's stderr.
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(line_formatter())
    logger = logging.getLogger("roundhouse.format-test")
    logger.addHandler(handler)
    logger.propagate = False
    logger.warning("hello")
    logger.removeHandler(handler)
    (line,) = stream.getvalue().splitlines()
    assert re.match(LINE_PATTERN, line) and line.endswith(" WARNING hello")
    # UTC, like the request log's ts.
    stamped = calendar.timegm(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
    assert abs(stamped - time.time()) < 5


def test_request_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.requests")
    lines = RequestLogLines()
    ok = generated()
    ok.id = "req-1"
    lines.request_admitted(ok)
    lines.request_admitted(ok)
    lines.request_finished(ok)
    refused = finished("rejected", 400, model=None, code="invalid_json")
    refused.id = "req-2"
    lines.request_finished(refused)
    gone = generated("cancelled", 499)
    gone.id = "req-3"
    lines.request_finished(gone)
    failed = generated("rejected", 503, code="engine_failed")
    failed.id = "req-4"
    lines.request_finished(failed)
    route = "POST /v1/chat/completions"
    tokens = ("37 prompt (32 cached: 16 device + 8 host + 8 partial) + 12 generated tokens "
              "(5 reasoning)")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"request req-1 {route} model=qwen3 key=cli-1 started"),
        ("INFO", f"request req-1 {route} model=qwen3 key=cli-1 done 200 in 1.50s: {tokens}, stop"),
        ("INFO", f"request req-2 {route} key=cli-1 rejected 400 invalid_json in 1.50s"),
        ("INFO", f"request req-3 {route} model=qwen3 key=cli-1 cancelled by the client after 1.50s: {tokens}"),
        ("WARNING", f"request req-4 {route} model=qwen3 key=cli-1 error 503 engine_failed in 1.50s: {tokens}"),
    ]


def test_the_throughput_line_quiets_down_when_idle(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="router.requests")
    busy = ModelThroughput("qwen3", 10.0, 8000, 6000, 960, 3, 0, 1, 4, 123, 1024)
    idle = ModelThroughput("qwen3", 10.0, 0, 0, 0, 0, 0, 0, 0, 0, 1024)
    report = ThroughputLines()
    for sample in (busy, idle, idle, busy):
        report([sample])
    assert [r.levelname for r in caplog.records] == ["INFO", "INFO", "DEBUG", "INFO"]
    assert caplog.records[0].getMessage() == (
        "throughput qwen3: prompt 800.0 tok/s (75% cached), generated 96.0 tok/s, "
        "running 3, waiting 1, queued 4, KV 12% (123/1024 pages)")


def test_throughput_counts_each_engine_from_its_own_start() -> None:
    now = [100.0]
    meter = ThroughputMeter(clock=lambda: now[0])

    def slot(name: str, engine: object, state: ModelState = ModelState.LOADED) -> SimpleNamespace:
        return SimpleNamespace(id=name, state=state, engine=engine, lanes=SimpleNamespace(waiting=5))

    first = SimpleNamespace(client=SimpleNamespace(stats=EngineStats()))
    asleep = SimpleNamespace(client=SimpleNamespace(stats=EngineStats(generated_tokens_total=9)))
    slots = [slot("a", first), slot("b", asleep, ModelState.SLEEPING)]
    first.client.stats = EngineStats(prompt_tokens_total=100, generated_tokens_total=40, running=2)
    now[0] = 102.0
    (a,) = meter.sample(slots)  # type: ignore[arg-type]
    assert (a.model, a.seconds, a.prompt_tokens, a.generated_tokens, a.running, a.queued) == (
        "a", 2.0, 100, 40, 2, 5)
    assert a.per_second(a.generated_tokens) == 20.0
    # The model was reloaded: the new engine's counters start again at 0.
    second = SimpleNamespace(client=SimpleNamespace(stats=EngineStats(generated_tokens_total=10)))
    slots[0] = slot("a", second)
    now[0] = 104.0
    (a,) = meter.sample(slots)  # type: ignore[arg-type]
    assert (a.seconds, a.generated_tokens) == (2.0, 10)
    second.client.stats = EngineStats(generated_tokens_total=16)
    now[0] = 105.0
    (a,) = meter.sample(slots)  # type: ignore[arg-type]
    assert (a.seconds, a.generated_tokens) == (1.0, 6)


# ---- a real router in this process: nothing of the prompt anywhere ----------------------


async def serve_and_ask(config: ServeConfig, requests: list[dict[str, Any]],
                        settled: Callable[[], bool]) -> None:
    from router.app import create_app
    from router.lifecycle import ModelManager
    from router.observability.operator_logs import OperatorLogs

    catalog = build_catalog(config)
    logs = OperatorLogs.open(config, catalog, ["roundhouse", "serve"])
    manager = ModelManager(catalog, config)
    logs.attach(manager)
    runner = web.AppRunner(create_app(manager), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    url = f"http://{config.host}:{config.port}"
    try:
        async with aiohttp.ClientSession() as session:
            for body in requests:
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    await response.read()
            for _ in range(500):  # until a throughput report came (5 s at most)
                if settled():
                    break
                await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
        await logs.close(0)


def test_no_prompt_or_output_text_reaches_either_log(
        tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    models = tmp_path / "models"
    models.mkdir()
    scripted_model(models / "qwen3-scripted", tiny_qwen3_dir, QWEN3_SCRIPT)
    config = ServeConfig(models_dir=models, port=free_port(), request_log_jsonl=tmp_path / "r.jsonl",
                         log_stats_interval_ms=100)
    caplog.set_level(logging.DEBUG)
    say = [{"role": "user", "content": f"Say hello to {MARKER}"}]
    asyncio.run(serve_and_ask(config, [
        {"model": "qwen3-scripted", "messages": say},
        {"model": "qwen3-scripted", "messages": say, "stream": True},
        {"model": "qwen3-scripted", "messages": say, "max_tokens": "many"},
        {"model": f"{MARKER}-model", "messages": say},
    ], lambda: any(r.getMessage().startswith("throughput qwen3-scripted:") for r in caplog.records)))
    events = read_events(tmp_path / "r.jsonl")
    assert [e["event"] for e in events if e["event"].startswith("request_")] == [
        "request_start", "request_done", "request_start", "request_done",
        "request_rejected", "request_rejected"]
    for event in events:
        assert schema_errors(event) == [], event
    text = (tmp_path / "r.jsonl").read_text()
    assert MARKER not in text and "Hello!" not in text and "greeting" not in text
    messages = [record.getMessage() for record in caplog.records]
    assert any(" done 200 " in m for m in messages)
    assert any(m.startswith("throughput qwen3-scripted:") for m in messages)
    leaks = [m for m in messages if MARKER in m or "Hello!" in m or "greeting" in m]
    assert leaks == []
