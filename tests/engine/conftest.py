"""Fixtures of the engine tests: transformers' own models of the test checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf: Path) -> torch.nn.Module:
    """SmolLM2-135M (real weights) as transformers loads its GGUF, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3_reference(tiny_qwen3_dir: Path) -> torch.nn.Module:
    """The small random Qwen3 as transformers loads it, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
