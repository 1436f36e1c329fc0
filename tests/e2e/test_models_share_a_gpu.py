"""Several models on one GPU, planned by device memory (run on the lent H200).

Three Qwen3 shapes (0.6B, 1.7B, 8B; zero weights in sparse files, which the
planner and the engine treat like any checkpoint) in one --models-dir on one
device: with default options every request succeeds and nothing runs out of
memory; with device shares that cannot all fit, each switch evicts the least
recently used model; a model bigger than the device is refused at once with
the numbers.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.server import Server, running_server
from tests.support.sparse_checkpoint import write_sparse_qwen3

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

HI = [{"role": "user", "content": "Say hi."}]
ORDER = ("small", "medium", "large")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_sparse_qwen3(root / "small", "qwen3-0.6b")
    write_sparse_qwen3(root / "medium", "qwen3-1.7b")
    write_sparse_qwen3(root / "large", "qwen3-8b")
    return root


def ask(server: Server, model: str) -> dict:
    reply = server.post("/v1/chat/completions",
                        json={"model": model, "messages": HI, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    return reply.json()


def states(server: Server) -> dict[str, str]:
    return {card["id"]: card["status"]["value"] for card in server.get("/models").json()["data"]}


def check_ledger(server: Server) -> None:
    load = server.get("/v1/load").json()
    for device in load["devices"]:
        assert device["planned_bytes"] + device["other_bytes"] + device["headroom_bytes"] \
            <= device["total_bytes"], device


def test_three_models_take_turns_on_one_gpu_with_default_options(models_dir: Path,
                                                                 tmp_path: Path) -> None:
    args = ["--models-dir", str(models_dir), "--device-headroom-mib", "2048"]
    with running_server(args, tmp_path / "router.log") as server:
        for model in ORDER + ORDER:
            assert ask(server, model)["usage"]["completion_tokens"] == 4
            check_ledger(server)
        cards = {card["id"]: card for card in server.get("/models").json()["data"]}
        for card in cards.values():
            if card["status"]["value"] == "loaded":
                memory = card["memory"]
                assert memory["device"] == "cuda:0" and memory["held"]["kv_bytes"] > 0
    log = server.log()
    assert "out of memory" not in log.lower(), log[-3000:]


def test_device_shares_force_least_recently_used_evictions(models_dir: Path,
                                                           tmp_path: Path) -> None:
    preset = tmp_path / "shares.ini"
    # Any two fit on an H200 (141 GB), all three do not.
    preset.write_text("[small]\ndevice-memory-mib = 52000\n"
                      "[medium]\ndevice-memory-mib = 52000\n"
                      "[large]\ndevice-memory-mib = 60000\nmax-context = 8192\n")
    args = ["--models-dir", str(models_dir), "--models-preset", str(preset)]
    with running_server(args, tmp_path / "router.log") as server:
        ask(server, "small")
        ask(server, "medium")
        assert states(server) == {"small": "loaded", "medium": "loaded", "large": "unloaded"}
        expected_victims = ["small", "medium", "large", "small"]
        for model, victim in zip(["large", "small", "medium", "large"], expected_victims,
                                 strict=True):
            ask(server, model)
            now = states(server)
            assert now[model] == "loaded" and now[victim] == "unloaded", (model, now)
            assert sum(state == "loaded" for state in now.values()) == 2, now
            check_ledger(server)
        evictions = [line for line in server.log().splitlines()
                     if "(least recently used) to make room for" in line]
        assert len(evictions) == len(expected_victims), evictions
        for line, victim, model in zip(evictions, expected_victims,
                                       ["large", "small", "medium", "large"], strict=True):
            assert f"unloading {victim} (least recently used) to make room for {model}: " \
                   "device memory on GPU 0" in line, line
    assert "out of memory" not in server.log().lower()


def test_a_model_bigger_than_the_gpu_is_refused_at_once(tmp_path: Path) -> None:
    root = tmp_path / "models"
    # About 220 GB of bf16 weights: no H200 holds it.
    write_sparse_qwen3(root / "huge", "qwen3-8b", num_hidden_layers=500)
    write_sparse_qwen3(root / "small", "qwen3-0.6b")
    with running_server(["--models-dir", str(root)], tmp_path / "router.log") as server:
        ask(server, "small")
        started = time.monotonic()
        reply = server.post("/v1/chat/completions",
                            json={"model": "huge", "messages": HI, "max_tokens": 4})
        took = time.monotonic() - started
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "insufficient_device_memory"
        assert "GiB" in error["message"] and "cannot fit even alone" in error["message"]
        assert took < 5, took
        # Nothing was evicted for it.
        assert states(server)["small"] == "loaded"
