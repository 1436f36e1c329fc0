"""llama.cpp's /slots through a real server (CPU engine): GET /slots's shape,
a completion pinned with id_slot saved to a file and restored after a
restart giving the tokens computed from scratch, filename rules, damaged
files, concurrent actions, and ?model= in router mode."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import Server, running_server

PROMPT = "The history of the railway roundhouse begins with steam engines " * 4
FOLLOW_UP = PROMPT + " and then the turntable"


def serve(model: Path, save_dir: Path, log_path: Path) -> Any:
    return running_server([str(model), "--device", "cpu", "--threads", "1", "--page-size", "8",
                           "--max-concurrency", "2", "--slot-save-path", str(save_dir)], log_path)


def complete(server: Server, prompt: str, **fields: object) -> dict[str, Any]:
    response = server.post("/completion", json={"prompt": prompt, "n_predict": 6,
                                                "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def action(server: Server, id_slot: int, name: str, filename: object = None) -> Any:
    body = {} if filename is None else {"filename": filename}
    return server.post(f"/slots/{id_slot}?action={name}", json=body)


def test_a_saved_slot_restored_after_a_restart_is_reused_exactly(
        tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    saves = tmp_path / "slots"
    with serve(tiny_qwen3_dir, saves, tmp_path / "first.log") as server:
        scratch = complete(server, FOLLOW_UP)
        pinned = complete(server, PROMPT, id_slot=1)
        assert pinned["id_slot"] == 1
        slots = server.get("/slots").json()
        assert [s["id"] for s in slots] == [0, 1]
        assert slots[1]["is_processing"] is False and PROMPT.strip() in slots[1]["prompt"]
        assert slots[1]["n_ctx"] > 0 and slots[1]["params"]["n_predict"] == 6
        assert {"id_task", "next_token", "params", "speculative"} <= slots[0].keys()

        saved = action(server, 1, "save", "Chat.bin")
        assert saved.status_code == 200, saved.text
        body = saved.json()
        assert body["id_slot"] == 1 and body["filename"] == "Chat.bin"
        assert body["n_saved"] == pinned["tokens_evaluated"] + 6
        assert body["n_written"] == (saves / "Chat.bin").stat().st_size
        assert "save_ms" in body["timings"]
        # Names compare case-insensitively: the same file.
        assert action(server, 0, "save", "chat.BIN").status_code == 200
        assert sorted(p.name for p in saves.iterdir()) == ["Chat.bin"]
        assert action(server, 1, "save", "Chat.bin").status_code == 200

    with serve(tiny_qwen3_dir, saves, tmp_path / "second.log") as server:
        restored = action(server, 0, "restore", "chat.bin")
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == body["n_saved"]
        assert restored.json()["n_read"] == body["n_written"]
        again = complete(server, FOLLOW_UP)
        assert again["content"] == scratch["content"]
        assert again["tokens_cached"] >= 8 and scratch["tokens_cached"] == 0
        # The follow-up ran in lane 0 (the lowest free one): erased, it is its tokens.
        erased = action(server, 0, "erase")
        assert erased.json() == {"id_slot": 0, "n_erased": again["tokens_evaluated"] + 6}


@pytest.mark.parametrize("filename", ["", ".hidden", "trailing.", "a/b", "../x", "x" * 129,
                                      "sp ace", "naïve", 7])
def test_invalid_filenames_are_refused(tiny_qwen3_dir: Path, tmp_path: Path,
                                       filename: object, slots_server: Server) -> None:
    response = action(slots_server, 0, "save", filename)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Invalid filename"


@pytest.fixture(scope="module")
def slots_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("slots")
    with serve(tiny_qwen3_dir, directory / "saves", directory / "server.log") as server:
        server.save_dir = directory / "saves"  # type: ignore[attr-defined]
        yield server


def test_damaged_files_unknown_slots_and_actions_are_400(slots_server: Server) -> None:
    complete(slots_server, PROMPT, id_slot=0)
    assert action(slots_server, 0, "save", "good.bin").status_code == 200
    path = slots_server.save_dir / "good.bin"  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    (path.parent / "bad.bin").write_bytes(data)
    bad = action(slots_server, 1, "restore", "bad.bin")
    assert bad.status_code == 400 and "checksum" in bad.json()["error"]["message"]
    (path.parent / "cut.bin").write_bytes(data[:100])
    assert "truncated" in action(slots_server, 1, "restore", "cut.bin").json()["error"]["message"]
    assert action(slots_server, 1, "restore", "none.bin").status_code == 400
    assert action(slots_server, 5, "erase").json()["error"]["message"] == "Invalid slot ID"
    assert action(slots_server, 0, "fly").json()["error"]["message"] == "Invalid action"
    out_of_range = slots_server.post("/completion", json={"prompt": "hi", "id_slot": 9})
    assert out_of_range.status_code == 400 and "Invalid slot ID" in out_of_range.text


def test_concurrent_actions_on_one_slot_all_complete(slots_server: Server) -> None:
    complete(slots_server, PROMPT, id_slot=1)
    # one.bin exists before the burst: its restore may arrive before any of
    # the burst's saves (the threads race), and must still find a file.
    assert action(slots_server, 1, "save", "one.bin").status_code == 200
    calls = [("save", "one.bin"), ("erase", None), ("save", "two.bin"), ("restore", "one.bin"),
             ("save", "three.bin")] * 2
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda call: action(slots_server, 1, *call), calls))
    assert [r.status_code for r in results] == [200] * len(calls), [r.text for r in results]


def test_router_mode_needs_model_and_refuses_actions_without_a_save_path(router: Server) -> None:
    assert router.get("/slots").status_code == 400
    response = router.post("/completion", json={"model": "qwen3-tiny", "prompt": PROMPT,
                                                "n_predict": 2, "id_slot": 3})
    assert response.status_code == 200, response.text
    slots = router.get("/slots?model=qwen3-tiny").json()
    assert len(slots) == 8 and PROMPT.strip() in slots[3]["prompt"]
    refused = router.post("/slots/0?action=save&model=qwen3-tiny", json={"filename": "a.bin"})
    assert refused.status_code == 501
    assert "--slot-save-path" in refused.json()["error"]["message"]
