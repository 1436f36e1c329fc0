"""Model architectures by Hugging Face class name, and the factory that builds them."""

from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.models.decoder import CausalLM
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    cls.__name__: cls
    for cls in (LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM,
                Qwen3ForCausalLM, Qwen3MoeForCausalLM)
}
_GGUF_ARCHITECTURES: dict[str, str] = {
    cls.gguf_architecture: name for name, cls in ARCHITECTURES.items() if cls.gguf_architecture
}


def model_class(architecture: str) -> type[CausalLM]:
    """The model class for an HF architecture name; ValueError when unsupported."""
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return cls


def gguf_architecture(name: str) -> str:
    """The HF architecture name for a GGUF general.architecture value."""
    architecture = _GGUF_ARCHITECTURES.get(name)
    if architecture is None:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported; "
            f"supported: {', '.join(sorted(_GGUF_ARCHITECTURES))}"
        )
    return architecture


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """A model of config's architecture with uninitialized weights on device."""
    return model_class(config.architecture)(config, device, dtype)


__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "build_model",
    "gguf_architecture",
    "model_class",
]
