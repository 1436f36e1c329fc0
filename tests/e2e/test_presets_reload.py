"""A router over --models-dir and --models-preset: precedence, aliases,
load-on-startup and ?reload=1, with real engines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.lifecycle_support import alive, card, complete, pid, status
from tests.support.server import Server, running_server, wait_until
from tests.support.sse import SseWatcher

pytestmark = pytest.mark.slow

PRESET = """\
version = 1
; every model, unless it or the command line says otherwise
[*]
max-context = 1024
max-concurrency = 2

[qwen3-tiny]
max-context = 512
alias = tiny, q3

# a model that only the preset knows
[extra-llama]
model = {llama}
load-on-startup = true
"""


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("presets")
    models = root / "models"
    models.mkdir()
    (models / "qwen3-tiny").symlink_to(tiny_model_factory("qwen3"), target_is_directory=True)
    (models / "qwen2-tiny").symlink_to(tiny_model_factory("qwen2"), target_is_directory=True)
    preset = root / "models.ini"
    preset.write_text(PRESET.format(llama=tiny_model_factory("llama")))
    return models, preset


@pytest.fixture(scope="module")
def server(layout: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models, preset = layout
    # The command line beats the preset: 4 lanes, not [*]'s 2.
    args = ["--models-dir", str(models), "--models-preset", str(preset), "--models-max", "0",
            "--max-concurrency", "4", "--threads", "1"]
    with running_server(args, tmp_path_factory.mktemp("presets-log") / "router.log") as running:
        yield running


def test_load_on_startup_and_precedence(server: Server) -> None:
    wait_until(lambda: status(server, "extra-llama") == "loaded", 60, "load-on-startup")
    assert status(server, "qwen3-tiny") == "unloaded"
    # An alias names the model; the response names its id.
    reply = complete(server, "tiny")
    assert reply.status_code == 200 and reply.json()["model"] == "qwen3-tiny"
    qwen3 = card(server, "qwen3-tiny")
    assert qwen3["aliases"] == ["tiny", "q3"]
    assert qwen3["meta"]["n_ctx"] == 512  # its section beats [*]
    complete(server, "qwen2-tiny")
    assert card(server, "qwen2-tiny")["meta"]["n_ctx"] == 1024  # [*]
    assert card(server, "extra-llama")["meta"]["n_ctx"] == 1024
    lanes = {m["model"]: m["capacity"]["max_concurrency"]
             for m in server.get("/v1/load").json()["models"] if "capacity" in m}
    assert lanes == {"qwen3-tiny": 4, "qwen2-tiny": 4, "extra-llama": 4}


def test_reload_adds_changes_and_removes(server: Server, layout: tuple[Path, Path],
                                         tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    models, preset = layout
    complete(server, "qwen3-tiny")
    complete(server, "qwen2-tiny")
    qwen3, qwen2 = pid(server, "qwen3-tiny"), pid(server, "qwen2-tiny")
    watcher = SseWatcher(server.url + "/models/sse")
    try:
        (models / "llama-new").symlink_to(tiny_model_factory("llama"), target_is_directory=True)
        (models / "qwen2-tiny").unlink()
        preset.write_text(preset.read_text().replace("max-context = 512", "max-context = 256"))
        listed = server.get("/models", params={"reload": "1"}).json()["data"]
        ids = {m["id"]: m for m in listed}
        assert set(ids) == {"qwen3-tiny", "extra-llama", "llama-new"}
        assert ids["llama-new"]["status"]["value"] == "unloaded"
        # Running but changed or removed: unloaded.
        assert ids["qwen3-tiny"]["status"]["value"] == "unloaded"
        wait_until(lambda: not alive(qwen3) and not alive(qwen2), 10, "the engines to stop")
        # Untouched and running: still running.
        assert ids["extra-llama"]["status"]["value"] == "loaded"
        watcher.wait_for(lambda: any(e["event"] == "models_reload" for e in watcher.events),
                         what="models_reload")
        assert {"model": "qwen2-tiny", "event": "model_remove"} in watcher.events
        assert watcher.events[-1] == {"model": "*", "event": "models_reload"}
        complete(server, "qwen3-tiny")
        assert card(server, "qwen3-tiny")["meta"]["n_ctx"] == 256
        assert complete(server, "qwen2-tiny").status_code == 404
    finally:
        watcher.close()


def test_a_broken_preset_leaves_the_catalog_as_it_was(server: Server, layout: tuple[Path, Path]) -> None:
    _, preset = layout
    good = preset.read_text()
    try:
        preset.write_text(good + "\n[qwen3-tiny]\nmax-context = 128\n")
        response = server.get("/models", params={"reload": "1"})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "models.ini:" in message and "qwen3-tiny" in message
        assert "qwen3-tiny" in {m["id"] for m in server.get("/models").json()["data"]}
    finally:
        preset.write_text(good)
