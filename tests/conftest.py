"""Shared fixtures: real models from registries, tiny random models, GPU skip."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import fixtures


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module's in-process model runs: the CI machine
    has two cores shared with the test's own server processes."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return fixtures.smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    """SmolLM2-135M (real weights) as transformers loads its GGUF, float32.
    Once per session: dequantizing the GGUF takes transformers 10-15 s here,
    and the engine and e2e tests only ever run it forward."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    """transformers' tokenizer of SmolLM2's GGUF (read from the GGUF: several seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    return fixtures.qwen3_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """Build (once per session) a tiny random-weight model of an architecture."""
    from tests.support.tiny_models import build_tiny_model

    built: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}") / f"tiny-{arch}")
        return built[arch]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3")
