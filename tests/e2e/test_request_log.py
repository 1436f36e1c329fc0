"""A real server with --request-log-jsonl and API keys, driven through a
request that runs, two refusals and a stream its client abandons; then the
file and the server's stderr are read back after it stops."""

from __future__ import annotations

import calendar
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from router.observability.logging_setup import LINE_PATTERN
from tests.support.json_schema import errors
from tests.support.request_log_schema import EVENT_SCHEMAS
from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import running_server, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MARKER = "quetzalcoatl7"
KEYS = ("sk-rl-first-0123456789", "sk-rl-second-9876543210")
MODEL = "qwen3-scripted"


@dataclass
class Run:
    events: list[dict[str, Any]]
    text: str
    stderr: str
    ids: dict[str, str]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def for_request(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("request_id") == self.ids[name]]


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Run:
    base = tmp_path_factory.mktemp("request-log")
    models = base / "models"
    models.mkdir()
    scripted_model(models / MODEL, tiny_qwen3_dir, QWEN3_SCRIPT)
    path = base / "requests.jsonl"
    args = ["--models-dir", str(models), "--models-max", "0", "--request-log-jsonl", str(path),
            "--log-stats-interval-ms", "200", "--api-key", KEYS[0], f"--api-key={KEYS[1]}"]
    auth = {"Authorization": f"Bearer {KEYS[0]}"}

    def ids_of(kind: str) -> list[str]:
        return [e["request_id"] for e in read(path) if e["event"] == kind]

    def chat(text: str, **body: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": [{"role": "user", "content": text}], **body}

    ids: dict[str, str] = {}
    with running_server(args, base / "router.log", env=ENGINE_ENV) as server:
        done = server.post("/v1/chat/completions", headers=auth, json=chat(f"Say hello, {MARKER}"))
        assert done.status_code == 200, done.text
        bad = server.post("/v1/chat/completions", headers=auth, data=b"{not json")
        assert bad.status_code == 400
        unknown = server.post("/v1/chat/completions", headers=auth, json={**chat("hi"), "model": "nope"})
        assert unknown.status_code == 404
        wait_until(lambda: len(ids_of("request_done")) == 1 and len(ids_of("request_rejected")) == 2,
                   10, "the first three requests in the log", server)
        ids["done"], = ids_of("request_done")
        ids["bad"], ids["unknown"] = ids_of("request_rejected")
        # A stream the client leaves after its first words (the story is
        # hundreds of tokens at 5 ms each).
        with requests.post(server.url + "/v1/chat/completions", headers=auth, stream=True,
                           json=chat(f"Tell me a long story about {MARKER}", stream=True),
                           timeout=60) as stream:
            for line in stream.iter_lines():
                if re.search(rb'"content": ?"[^"]', line):  # words, not the role chunk
                    break
        wait_until(lambda: len(ids_of("request_cancelled")) == 1, 20, "the abandoned stream", server)
        ids["abandoned"], = ids_of("request_cancelled")
        wait_until(lambda: any(m["generated_tokens"] for e in read(path) if e["event"] == "throughput"
                               for m in e["models"]), 10, "a throughput event with work", server)
    return Run(read(path), path.read_text(), (base / "router.log").read_text(), ids)


def test_server_start_describes_the_run_without_its_keys(run: Run) -> None:
    start = run.events[0]
    assert start["event"] == "server_start"
    assert start["version"] and start["pid"] > 0
    argv = start["argv"]
    assert argv[argv.index("--api-key") + 1] == "<redacted>"
    assert "--api-key=<redacted>" in argv
    assert start["options"]["api_keys"] == 2 and start["options"]["log_stats_interval_ms"] == 200
    assert [entry["id"] for entry in start["catalog"]] == [MODEL]
    assert start["memory"]["host_total_bytes"] > 0
    (loaded,) = run.of("model_loaded")
    assert loaded["model"] == MODEL and loaded["kv"]["pages"] == 1024 and loaded["context"] > 0


def test_a_request_that_runs_has_a_start_and_a_done(run: Run) -> None:
    start, done = run.for_request("done")
    assert (start["event"], done["event"]) == ("request_start", "request_done")
    for event in (start, done):
        assert (event["model"], event["route"], event["api"], event["method"]) == (
            MODEL, "/v1/chat/completions", "openai", "POST")
        # With the auth middleware in place the key's label, never the key.
        assert event["key"] in ("cli-1", None)
    assert done["status"] == 200 and done["finish_reason"] == "stop"
    assert done["engine_request_id"].startswith("chatcmpl-")
    assert done["prompt_tokens"] > 0 and done["cached_tokens"] == 0
    assert 0 < done["reasoning_tokens"] < done["completion_tokens"]
    stages = done["stages"]
    assert all(stages[name] is not None for name in ("queue", "prefill", "decode", "total"))
    # The first request waited for the model's load, in the queue stage.
    assert stages["queue"] == pytest.approx(start["queue_seconds"], abs=1e-5)
    assert stages["queue"] + stages["prefill"] + stages["decode"] <= stages["total"] + 1e-3


def test_refusals_are_rejected_with_their_codes(run: Run) -> None:
    (bad,) = run.for_request("bad")
    (unknown,) = run.for_request("unknown")
    assert (bad["event"], bad["status"], bad["error_code"]) == ("request_rejected", 400, "invalid_json")
    assert (unknown["event"], unknown["status"], unknown["error_code"]) == (
        "request_rejected", 404, "model_not_found")
    assert bad["model"] is None and bad["stages"]["queue"] is None


def test_an_abandoned_stream_is_cancelled_with_what_it_generated(run: Run) -> None:
    start, cancelled = run.for_request("abandoned")
    assert (start["event"], cancelled["event"]) == ("request_start", "request_cancelled")
    assert cancelled["status"] == 499 and cancelled["model"] == MODEL
    assert 0 < cancelled["completion_tokens"] < 300
    assert cancelled["finish_reason"] in (None, "abort")


def test_every_event_matches_its_schema_and_the_run_ends_cleanly(run: Run) -> None:
    for event in run.events:
        assert errors(event, EVENT_SCHEMAS[event["event"]]) == [], event
    stamps = [e["ts"] for e in run.events]
    assert stamps == sorted(stamps)
    assert run.events[-1]["event"] == "server_stop"
    assert run.events[-1]["exit_status"] == 0 and run.events[-1]["events_dropped"] == 0
    busy = [m for e in run.of("throughput") for m in e["models"] if m["generated_tokens"]]
    assert busy and all(m["model"] == MODEL and m["generated_tokens_per_second"] > 0 for m in busy)


def test_no_prompt_output_or_key_in_either_log(run: Run) -> None:
    for secret in (MARKER, *KEYS, "Hello! How can I help", "Once upon a time", "greeting"):
        assert secret not in run.text, secret
        assert secret not in run.stderr, secret


def test_stderr_lines_share_one_format(run: Run) -> None:
    lines = run.stderr.splitlines()
    assert lines and [line for line in lines if not re.match(LINE_PATTERN, line)] == []
    done, bad, abandoned = run.ids["done"], run.ids["bad"], run.ids["abandoned"]
    route = "POST /v1/chat/completions"
    expected = [
        rf"INFO request {done} {route} model={MODEL}( key=cli-1)? started$",
        rf"INFO request {done} {route} model={MODEL}( key=cli-1)? done 200 in \d+\.\d\ds: "
        r"\d+ prompt \+ \d+ generated tokens \(\d+ reasoning\), stop$",
        rf"INFO request {bad} {route}( key=cli-1)? rejected 400 invalid_json in \d+\.\d\ds$",
        rf"INFO request {abandoned} {route} model={MODEL}( key=cli-1)? cancelled by the client "
        r"after \d+\.\d\ds: \d+ prompt \+ \d+ generated tokens?$",
        rf"INFO throughput {MODEL}: prompt \d+\.\d tok/s \(0% cached\), generated \d+\.\d tok/s, "
        r"running \d+, waiting \d+, queued \d+, KV \d+% \(\d+/1024 pages\)$",
    ]
    for pattern in expected:
        assert any(re.search(pattern, line) for line in lines), pattern


def test_engine_lines_share_the_format(tmp_path: Path) -> None:
    # The real engine, failing at once on a model that is not there: its
    # first line is a log line, in the router's format.
    done = subprocess.run(
        [sys.executable, "-m", "engine", "--model", str(tmp_path / "missing.gguf"),
         "--input", f"ipc://{tmp_path}/in", "--output", f"ipc://{tmp_path}/out"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    first = done.stderr.splitlines()[0]
    assert re.match(LINE_PATTERN + "engine failed$", first), first
    stamped = calendar.timegm(time.strptime(first[:19], "%Y-%m-%d %H:%M:%S"))
    assert abs(stamped - time.time()) < 120  # UTC
