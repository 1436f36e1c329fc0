"""A router over a --models-dir with two real models and a broken one, and the
tiny Qwen3 served alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.broken_model import write_broken_model
from tests.support.server import Server, running_server


@pytest.fixture(scope="package")
def models_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path, tiny_qwen3_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("models")
    (directory / "smollm2.gguf").symlink_to(smollm2_gguf)
    (directory / "qwen3-tiny").symlink_to(tiny_qwen3_dir, target_is_directory=True)
    write_broken_model(directory / "broken", tiny_qwen3_dir)
    # Not a model: skipped by the catalog with a log line.
    (directory / "notes.txt").write_text("not a model")
    return directory


@pytest.fixture(scope="package")
def router(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "router.log"
    args = ["--models-dir", str(models_dir), "--models-max", "1", "--threads", "1",
            "--max-concurrency", "8"]
    with running_server(args, log) as server:
        yield server


@pytest.fixture(scope="package")
def client(router: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="package")
def tiny_qwen3_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`serve <tiny Qwen3> --threads 1`, shared by the modules that only send it
    independent requests (strict tools, forced tools, the Responses API's JSON
    schema): one start, where each module's own took 4 s on CI's two cores."""
    log = tmp_path_factory.mktemp("tiny-qwen3-server") / "router.log"
    with running_server([str(tiny_qwen3_dir), "--threads", "1"], log) as server:
        yield server


@pytest.fixture(scope="package")
def smollm2_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`serve <SmolLM2> --threads 1 --max-concurrency 4`, shared by the modules
    that send a single-model server independent requests (llama.cpp's API on
    one model, the Responses API's log probabilities): one start of SmolLM2,
    where each module's own took 10 s on CI's two cores."""
    log = tmp_path_factory.mktemp("smollm2-server") / "router.log"
    with running_server([str(smollm2_gguf), "--threads", "1", "--max-concurrency", "4"], log) as server:
        yield server
