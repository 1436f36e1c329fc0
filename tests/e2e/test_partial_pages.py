"""Reuse to the token through a real server (CPU engine, pages of 16 tokens):
a repeated prompt reuses all but its last token, partial page included, and
every API's usage says so (OpenAI's cached_tokens, Anthropic's
cache_read_input_tokens, llama.cpp's tokens_cached), as do the request log's
per-tier counts and /metrics; llama.cpp's cache_prompt false reuses nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import Server, running_server, wait_until

PROMPT = [1000 + 37 * i for i in range(9)]  # 9 tokens: no full page


@pytest.fixture(scope="module")
def logged(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Server, Path]]:
    base = tmp_path_factory.mktemp("partial-pages")
    log = base / "requests.jsonl"
    args = [str(tiny_qwen3_dir), "--device", "cpu", "--threads", "1", "--page-size", "16",
            "--kv-capacity", "1024", "--max-concurrency", "2", "--request-log-jsonl", str(log)]
    with running_server(args, base / "router.log") as running:
        yield running, log


def completion(server: Server, prompt: list[int], **fields: Any) -> dict[str, Any]:
    response = server.post("/completion", json={"prompt": prompt, "n_predict": 3,
                                                 "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def tiers(log: Path, server: Server) -> list[dict[str, int]]:
    def done() -> list[dict[str, Any]]:
        lines = log.read_text().splitlines() if log.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == "request_done"]
    wait_until(lambda: len(done()) >= 3, 10, "the request log's lines", server)
    return [e["cached_by_tier"] for e in done()]


def test_every_api_counts_the_partial_page(logged: tuple[Server, Path]) -> None:
    server, log = logged
    first = completion(server, PROMPT)
    assert first["tokens_cached"] == 0
    again = completion(server, PROMPT)
    assert again["tokens_cached"] == 8  # all but the last prompt token
    assert again["content"] == first["content"]
    off = completion(server, PROMPT, cache_prompt=False)
    assert off["tokens_cached"] == 0 and off["content"] == first["content"]
    assert tiers(log, server)[:3] == [
        {"device": 0, "host": 0, "disk": 0, "partial": 0},
        {"device": 0, "host": 0, "disk": 0, "partial": 8},
        {"device": 0, "host": 0, "disk": 0, "partial": 0}]

    openai = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                  "temperature": 0})
    assert openai.status_code == 200, openai.text
    assert openai.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8

    body = {"model": "tiny-qwen3", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "copper lantern by the river"}]}
    headers = {"anthropic-version": "2023-06-01"}
    server.post("/v1/messages", json=body, headers=headers)
    reply = server.post("/v1/messages", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    prompt_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert (prompt_tokens - 1) % 16, "the prompt must end inside a page; change the message"
    assert usage["cache_read_input_tokens"] == prompt_tokens - 1

    wait_until(lambda: "roundhouse:partial_kv_hit_tokens_total" in server.get("/metrics").text,
               10, "the partial-page counters", server)
    metrics = server.get("/metrics").text
    assert 'roundhouse:partial_kv_hits_total{model="tiny-qwen3"} 3.0' in metrics
