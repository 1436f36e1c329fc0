"""Router-side text processing of the real tokenizers, loaded once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.text import ModelText


@pytest.fixture(scope="session")
def smollm2_text(smollm2_gguf: Path) -> ModelText:
    return ModelText.load(smollm2_gguf)


@pytest.fixture(scope="session")
def qwen3_text(qwen3_tokenizer_dir: Path) -> ModelText:
    return ModelText.load(qwen3_tokenizer_dir)
