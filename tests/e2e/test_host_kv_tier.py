"""The prefix cache's host tier through a real server (CPU engine): a
conversation's second turn, sent after other conversations pushed its pages
out of a tiny device pool, gets its prefix back from the host tier, and says
so in usage.prompt_tokens_details.cached_tokens, /v1/load and /metrics."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import Server, running_server, wait_until

WORDS = ("river stone lantern copper meadow signal harbor velvet orchard thunder canyon "
         "saddle piano glacier ember falcon quarry lattice marble compass tundra "
         "beacon cobalt willow").split()


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 16 device pages of 8 tokens; a host tier of 256 such pages (1 MiB).
    args = [str(tiny_qwen3_dir), "--device", "cpu", "--threads", "1", "--page-size", "8",
            "--kv-capacity", "128", "--max-concurrency", "2", "--output-window", "8",
            "--host-kv-mib", "1"]
    with running_server(args, tmp_path_factory.mktemp("host-kv") / "router.log") as running:
        yield running


def message(seed: int, words: int = 24) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(server: Server, messages: list[dict[str, str]]) -> dict[str, Any]:
    response = server.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def counters(server: Server) -> dict[str, int]:
    (load,) = server.load().values()
    return load["counters"]


def test_a_second_turn_gets_its_prefix_from_the_host_tier(server: Server) -> None:
    turn = [{"role": "user", "content": message(1)}]
    first = chat(server, turn)
    assert first["usage"]["prompt_tokens"] > 40
    (load,) = server.load().values()
    assert load["occupancy"]["host_kv_capacity_pages"] == 256
    # Other conversations take every device page; turn one's pages go to the host.
    for seed in range(2, 7):
        chat(server, [{"role": "user", "content": message(seed)}])
    before = counters(server)
    assert before["host_kv_stored_pages"] > 0
    turn += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": message(9, 6)}]
    second = chat(server, turn)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 40 and cached % 8 == 0
    wait_until(lambda: counters(server)["host_kv_hit_tokens"] > before["host_kv_hit_tokens"],
               10, "the host tier's hits to be published", server)
    after = counters(server)
    # Every cached token of the second turn came from the host tier but its
    # first page's: the other conversations reused that page's chat-template
    # start to the token (engine/kv/partial_pages.py), which kept it on the device.
    assert after["host_kv_hit_tokens"] - before["host_kv_hit_tokens"] == cached - 8
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == cached
    metrics = server.get("/metrics").text
    assert (f'roundhouse:host_kv_hit_tokens_total{{model="tiny-qwen3"}} '
            f"{float(after['host_kv_hit_tokens'])}") in metrics
