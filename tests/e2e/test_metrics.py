"""GET /metrics on a real router with two tiny models, read the way
Prometheus reads it (prometheus_client's text parser)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.lifecycle_support import complete, held_stream, pid
from tests.support.llamacpp_series import LLAMACPP_TYPES
from tests.support.server import Server, running_server, wait_until

pytestmark = pytest.mark.slow

MODELS = ("qwen3-tiny", "qwen2-tiny")



@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("metrics") / "models"
    directory.mkdir()
    for name in MODELS:
        (directory / name).symlink_to(tiny_model_factory(name.split("-")[0]), target_is_directory=True)
    args = ["--models-dir", str(directory), "--models-max", "2", "--model-suspend",
            "--suspend-weights", "host", "--threads", "1"]
    with running_server(args, tmp_path_factory.mktemp("metrics-log") / "router.log") as running:
        yield running


class Scrape:
    """One /metrics answer: samples by name and labels, types by exposed name."""

    def __init__(self, response: requests.Response):
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(response.text):
            exposed = family.name + ("_total" if family.type == "counter" else "")
            self.types[exposed] = family.type
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def get(self, name: str, **labels: str) -> float:
        """A sample's value; a series not created yet reads 0, as Prometheus' increase() does."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def models(self) -> set[str]:
        return {dict(labels)["model"] for _, labels in self.samples}


def scrape(server: Server, model: str | None = None) -> Scrape:
    return Scrape(server.get("/metrics", params={"model": model} if model else None))


def test_every_llamacpp_series_is_served_for_every_model(server: Server) -> None:
    metrics = scrape(server)
    assert {name: metrics.types.get(name) for name in LLAMACPP_TYPES} == LLAMACPP_TYPES
    for name in LLAMACPP_TYPES:
        assert {m for (sample, labels) in metrics.samples if sample == name
                for m in [dict(labels)["model"]]} == set(MODELS), name
    # Every series names its model.
    assert all("model" in dict(labels) for _, labels in metrics.samples)
    # llama.cpp serves /metrics only.
    assert server.get("/v1/metrics").status_code == 404


def test_a_request_is_counted_token_for_token(server: Server) -> None:
    before = scrape(server, "qwen3-tiny")
    # A fresh prompt shorter than a KV page: nothing of it can come from the cache.
    reply = complete(server, "qwen3-tiny", max_tokens=5)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    after = scrape(server, "qwen3-tiny")

    def delta(name: str, **labels: str) -> float:
        return after.get(name, model="qwen3-tiny", **labels) - before.get(name, model="qwen3-tiny", **labels)

    assert delta("llamacpp:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("roundhouse:prompt_tokens_received_total") == usage["prompt_tokens"]
    assert delta("llamacpp:tokens_predicted_total") == usage["completion_tokens"] == 5
    assert delta("llamacpp:prompt_seconds_total") > 0
    assert delta("llamacpp:tokens_predicted_seconds_total") > 0
    assert delta("llamacpp:n_decode_total") == 5  # one prefill step, then four decode steps
    assert after.get("llamacpp:n_busy_slots_per_decode", model="qwen3-tiny") >= 1
    assert after.get("llamacpp:requests_processing", model="qwen3-tiny") == 0
    assert delta("roundhouse:time_to_first_token_seconds_count") == 1
    assert delta("roundhouse:inter_token_latency_seconds_count") == 4


def test_counters_advance_during_a_long_generation(server: Server) -> None:
    complete(server, "qwen3-tiny")  # loaded before the clock starts
    advancing = ("llamacpp:tokens_predicted_total", "llamacpp:tokens_predicted_seconds_total",
                 "llamacpp:n_decode_total", "llamacpp:kv_cache_tokens")
    with held_stream(server, "qwen3-tiny") as stream:
        first = scrape(server, "qwen3-tiny")
        scrapes = [first]

        def advanced() -> bool:
            scrapes.append(scrape(server, "qwen3-tiny"))
            return all(scrapes[-1].get(name, model="qwen3-tiny") > first.get(name, model="qwen3-tiny")
                       for name in advancing)

        wait_until(advanced, 10, "the counters to advance", server)
        second = scrapes[-1]
        # Still running at the second scrape: the counts are not the totals of
        # a finished request.
        assert second.get("llamacpp:requests_processing", model="qwen3-tiny") == 1
        assert next(line for line in stream.iter_lines() if line.startswith(b"data: ")) != b"data: [DONE]"
    assert first.get("llamacpp:requests_processing", model="qwen3-tiny") == 1
    assert 0 < second.get("llamacpp:kv_cache_usage_ratio", model="qwen3-tiny") <= 1
    assert second.get("roundhouse:requests_in_flight", model="qwen3-tiny") == 1
    assert second.get("llamacpp:predicted_tokens_seconds", model="qwen3-tiny") > 0


def test_one_models_series_by_name_without_loading_it(server: Server) -> None:
    server.post("/models/unload", json={"model": "qwen2-tiny"})
    only = scrape(server, "qwen2-tiny")
    assert only.models() == {"qwen2-tiny"}
    assert set(LLAMACPP_TYPES) <= set(only.types)
    assert only.get("roundhouse:model_state", model="qwen2-tiny", state="unloaded") == 1
    # Scraping it loaded nothing.
    assert server.load()["qwen2-tiny"]["state"] == "unloaded"
    unknown = server.get("/metrics", params={"model": "nope"})
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert (error["code"], error["type"], error["reason"]) == (404, "not_found_error", "model_not_found")


def test_requests_by_outcome(server: Server) -> None:
    before = scrape(server)
    assert complete(server, "qwen3-tiny").status_code == 200
    too_long = server.post("/v1/completions", json={"model": "qwen3-tiny", "prompt": "hello " * 2100,
                                                    "max_tokens": 1})
    assert too_long.status_code == 400, too_long.text
    # Refused before it named a model.
    assert server.post("/v1/completions", data=b"{").status_code == 400
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert delta("roundhouse:requests_total", model="qwen3-tiny", outcome="ok") == 1
    assert delta("roundhouse:requests_total", model="qwen3-tiny", outcome="rejected") == 1
    assert delta("roundhouse:requests_total", model="qwen3-tiny", outcome="error") == 0
    assert delta("roundhouse:requests_rejected_total", model="qwen3-tiny",
                 reason="context_length_exceeded") == 1
    assert delta("roundhouse:requests_total", model="", outcome="rejected") == 1
    assert delta("roundhouse:requests_rejected_total", model="", reason="invalid_json") == 1


def test_lifecycle_transitions_are_counted(server: Server) -> None:
    model = "qwen2-tiny"
    server.post("/models/unload", json={"model": model})
    before = scrape(server, model)
    assert server.post("/models/load?wait=1", json={"model": model}).json() == {"success": True}
    assert server.post("/models/sleep", json={"model": model}).json() == {"success": True}
    assert complete(server, model).status_code == 200  # wakes it
    assert server.post("/models/unload", json={"model": model}).json() == {"success": True}
    after = scrape(server, model)

    def delta(name: str) -> float:
        return after.get(name, model=model) - before.get(name, model=model)

    assert {kind: delta(f"roundhouse:model_{kind}s_total")
            for kind in ("load", "sleep", "wake", "unload")} == {
        "load": 1, "sleep": 1, "wake": 1, "unload": 1}
    assert delta("roundhouse:model_load_seconds_count") == 1
    assert delta("roundhouse:model_load_seconds_sum") > 0
    assert delta("roundhouse:model_wake_seconds_count") == 1
    assert delta("roundhouse:engine_failures_total") == 0
    assert after.get("roundhouse:model_state", model=model, state="unloaded") == 1
    # The engine that served the request is gone; its tokens are not.
    assert delta("llamacpp:tokens_predicted_total") == 2


def test_an_engine_that_dies_keeps_its_counts(server: Server) -> None:
    model = "qwen2-tiny"
    assert complete(server, model).status_code == 200
    before = scrape(server, model)
    os.kill(pid(server, model), signal.SIGKILL)
    wait_until(lambda: server.load()[model]["state"] == "unloaded", 30, "the failure to show", server)
    dead = scrape(server, model)
    assert dead.get("roundhouse:engine_failures_total", model=model) == (
        before.get("roundhouse:engine_failures_total", model=model) + 1)
    for name in ("llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_total",
                 "llamacpp:n_decode_total", "llamacpp:tokens_predicted_seconds_total"):
        assert dead.get(name, model=model) == before.get(name, model=model), name
    # The next request starts a new engine; the counters go on from there.
    assert complete(server, model).status_code == 200
    again = scrape(server, model)
    assert again.get("llamacpp:tokens_predicted_total", model=model) == (
        before.get("llamacpp:tokens_predicted_total", model=model) + 2)
    assert again.get("roundhouse:model_loads_total", model=model) == (
        before.get("roundhouse:model_loads_total", model=model) + 1)


def test_scrapes_are_cheap_and_never_touch_an_engine(server: Server) -> None:
    server.post("/models/unload", json={"model": "qwen3-tiny"})
    started = time.monotonic()
    for _ in range(20):
        scrape(server)
    assert time.monotonic() - started < 5
    assert server.load()["qwen3-tiny"]["state"] == "unloaded"


def test_a_scrape_says_when_the_process_started(server: Server) -> None:
    """llama-server's Process-Start-Time-Unix header: a scraper sees a restart
    (counters back at zero) when it changes."""
    before = int(time.time())
    first = server.get("/metrics").headers["Process-Start-Time-Unix"]
    assert first == server.get("/metrics").headers["Process-Start-Time-Unix"]
    assert before - 600 < int(first) <= before
