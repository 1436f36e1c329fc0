"""load_model: a GGUF file or a Hugging Face directory -> a ready CausalLM on a device.

The model is allocated empty on the device first, then each checkpoint tensor
is read, dequantized or cast, and copied into its slot, so no more than one
tensor's worth of extra memory exists beside the weights at any time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine.loader.gguf_weights import GGUFCheckpoint
from engine.loader.hf_weights import HFCheckpoint
from engine.models import CausalLM, ModelConfig, build_model
from protocol import Pooling

ProgressCallback = Callable[[float, str], None]


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    n_params: int
    size_bytes: int  # bytes of the weights as stored on disk
    # The embedding pooling the checkpoint names itself (engine/loader/pooling.py).
    pooling: Pooling | None = None


class Checkpoint(Protocol):
    path: Path
    config: ModelConfig
    size_bytes: int
    pooling: Pooling | None
    # Whether each expert matrix of a layer comes as one tensor over all experts.
    stacked_experts: bool

    def tensors(self) -> Iterator[tuple[str, torch.Tensor, float]]: ...


def load_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    progress: ProgressCallback | None = None,
    host_expert_layers: int = 0,
) -> LoadedModel:
    """Load a .gguf file, a directory with config.json + *.safetensors, or a
    directory holding exactly one .gguf. progress(fraction, message) is called
    as weights load, about every 1%, and last with 1.0. The routed experts of
    the first host_expert_layers layers (-1: all) are filled in host memory
    (build_model). Raises ValueError with what to do for unsupported or
    incomplete checkpoints."""
    checkpoint = open_checkpoint(Path(path))
    model = build_model(checkpoint.config, device, dtype, host_expert_layers)
    report = _Throttled(progress)
    report(0.0)
    _fill_weights(model, checkpoint, report)
    report(1.0)
    n_params = sum(p.numel() for p in model.parameters())
    return LoadedModel(checkpoint.config, model, n_params, checkpoint.size_bytes,
                       checkpoint.pooling)


def open_checkpoint(path: Path) -> Checkpoint:
    """Pick the reader for what path holds; reads metadata, not weights."""
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a .gguf file; pass a .gguf file or a model directory")
        return GGUFCheckpoint(path)
    if (path / "config.json").is_file():
        return HFCheckpoint(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFCheckpoint(ggufs[0])
    if not ggufs:
        raise ValueError(
            f"{path} holds neither config.json (a Hugging Face model) nor a .gguf file"
        )
    raise ValueError(
        f"{path} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs[:4])}); "
        "point at one file (split GGUFs must be merged first with llama-gguf-split --merge)"
    )


def _fill_weights(model: CausalLM, checkpoint: Checkpoint, report: _Throttled) -> None:
    destinations = model.weight_destinations(stacked_experts=checkpoint.stacked_experts)
    with torch.no_grad():
        for name, tensor, fraction in checkpoint.tensors():
            dest = destinations.pop(name, None)
            if dest is None:
                raise ValueError(
                    f"{checkpoint.path.name}: unexpected tensor {name!r} for "
                    f"{checkpoint.config.architecture}; the checkpoint does not match its config"
                )
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(
                    f"{checkpoint.path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            del tensor
            report(fraction)
    if destinations:
        missing = sorted(destinations)
        raise ValueError(
            f"{checkpoint.path.name} lacks {len(missing)} weights (e.g. {', '.join(missing[:3])}); "
            "the checkpoint is incomplete"
        )


class _Throttled:
    """Forwards progress in steps of at least 1% so the router is not flooded."""

    def __init__(self, callback: ProgressCallback | None) -> None:
        self._callback = callback
        self._last = -1.0

    def __call__(self, fraction: float) -> None:
        if self._callback is None:
            return
        if fraction < 1.0 and fraction - self._last < 0.01:
            return
        if fraction == self._last:
            return
        self._last = fraction
        self._callback(fraction, f"loading weights {fraction:.0%}")


__all__ = ["LoadedModel", "load_model", "open_checkpoint"]
