"""Model architectures by Hugging Face class name, and the factory that builds them."""

from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.models.decoder import CausalLM, experts_on_host
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)
from engine.models.qwen_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)
from engine.parallel.tensor_parallel import SINGLE_RANK, TensorParallel

ARCHITECTURES: dict[str, type[CausalLM]] = {
    cls.__name__: cls
    for cls in (LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM,
                Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM,
                Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen2_5_VLForConditionalGeneration,
                Qwen3VLForConditionalGeneration)
}
# (general.architecture, whether the file has experts) -> HF architecture name.
_GGUF_ARCHITECTURES: dict[tuple[str, bool], str] = {
    (cls.gguf_architecture, cls.gguf_has_experts): name
    for name, cls in ARCHITECTURES.items() if cls.gguf_architecture
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


def gguf_architecture(name: str, has_experts: bool = False) -> str:
    """The HF architecture name for a GGUF general.architecture value, and
    whether the file's metadata names experts ({name}.expert_count > 0)."""
    architecture = _GGUF_ARCHITECTURES.get((name, has_experts))
    if architecture is None:
        supported = sorted(f"{arch} (with experts)" if experts else arch
                           for arch, experts in _GGUF_ARCHITECTURES)
        kind = "with" if has_experts else "without"
        raise ValueError(
            f"GGUF architecture {name!r} {kind} experts is not supported; "
            f"supported: {', '.join(supported)}"
        )
    return architecture


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                host_expert_layers: int = 0, with_mtp: bool = False,
                tp: TensorParallel = SINGLE_RANK) -> CausalLM:
    """A model of config's architecture with uninitialized weights on device,
    but the routed experts of the first host_expert_layers layers (-1: all)
    in host memory. ValueError when those layers have no experts: the option
    asking for it would do nothing. with_mtp: with the checkpoint's MTP head
    (--spec mtp; ValueError for a model that has none). tp: the
    tensor-parallel rank to build (engine/parallel/sharding.py; ValueError
    where the model does not split across its ranks)."""
    if host_expert_layers and not any(
            config.moe is not None and config.moe.is_sparse(layer)
            and experts_on_host(layer, host_expert_layers)
            for layer in range(config.num_layers)):
        where = ("has no experts" if config.moe is None
                 else f"has no experts in its first {host_expert_layers} layers")
        option = ("--expert-residency host (--cpu-moe)" if host_expert_layers < 0
                  else f"--n-cpu-moe {host_expert_layers}")
        raise ValueError(f"{option}: {config.architecture} {where}; drop the option for "
                         "this model")
    model = model_class(config.architecture)(config, device, dtype, host_expert_layers, tp=tp)
    if with_mtp:
        add_head = getattr(model, "add_mtp_head", None)
        if add_head is None or not config.mtp_layers:
            raise ValueError(f"--spec mtp: {config.architecture} checkpoints carry no MTP "
                             "(multi-token prediction) layers to draft with; use --spec ngram "
                             "or --spec draft")
        add_head(device, dtype)
    return model


__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "build_model",
    "gguf_architecture",
    "model_class",
]
