"""Fixtures of the engine tests: transformers' own models of the test checkpoints
(SmolLM2's, smollm2_reference, is session-wide in tests/conftest.py).

These tests run the engine in-process with no server beside it, so torch keeps
its default thread count (CI's two cores): one_torch_thread (tests/conftest.py)
is for tests that share the cores with server processes. On two idle cores the
exactness, speculation and penalty modules ran 74 s with one thread, 55 s with two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def qwen3_reference(tiny_qwen3_dir: Path) -> torch.nn.Module:
    """The small random Qwen3 as transformers loads it, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
