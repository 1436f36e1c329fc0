"""Which ops a model runs: the reference ops wherever our CUDA kernels cannot."""

from __future__ import annotations

import torch

from engine.execution.model_ops import REFERENCE_OPS, _skinny_wins, kernels_usable
from engine.models import ModelConfig
from tests.perf.gpu_models import hf_config


def config(**changes: object) -> ModelConfig:
    return ModelConfig.from_hf_config({**hf_config("qwen3-0.6b"), **changes})


def test_the_cpu_and_other_dtypes_and_head_sizes_take_the_reference_ops() -> None:
    assert not kernels_usable(torch.device("cpu"), torch.bfloat16, config())
    # Whatever the machine: float32 and head size 96 never reach the kernels.
    assert not kernels_usable(torch.device("cuda", 0), torch.float32, config())
    assert not kernels_usable(torch.device("cuda", 0), torch.bfloat16, config(head_dim=96))


def test_the_skinny_gemm_takes_only_the_matrices_it_measured_faster_on() -> None:
    assert _skinny_wins(1, 6144 * 1024) and _skinny_wins(8, 4096 * 4096)
    assert _skinny_wins(1, 6144 * 4096) and not _skinny_wins(4, 6144 * 4096)
    assert not _skinny_wins(1, 24576 * 4096)


def test_reference_linear_is_torch_linear() -> None:
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(REFERENCE_OPS.linear(x, w, b), torch.nn.functional.linear(x, w, b))
