"""load_model: a GGUF file or a Hugging Face directory -> a ready CausalLM on a device.

The model is allocated empty on the device first, then each checkpoint tensor
is read, dequantized or cast, and copied into its slot, so no more than one
tensor's worth of extra memory exists beside the weights at any time. A
tensor-parallel rank (engine/parallel/) copies only its part of each split
tensor (a ShardedSlot), so it holds its share of the model and one tensor. A GGUF
load for our GPU kernels keeps the quantized matrices in their blocks instead
(engine/loader/packing.py), and an FP8 load (a Hugging Face FP8 checkpoint,
or --quantize fp8) keeps the projection matrices in FP8 (same module).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine.execution.fp8_weight import fp8_kernels_available
from engine.execution.model_ops import kernels_usable
from engine.execution.quantized_weight import packed_kernels_available, quantized_weights
from engine.loader.gguf_weights import GGUFCheckpoint
from engine.loader.hf_weights import HFCheckpoint
from engine.loader.packing import PackingPlan, log_packing, plan_fp8, plan_packing
from engine.models import CausalLM, ModelConfig, build_model
from engine.models.weight_alloc import deferred_weights
from engine.parallel.sharding import ShardedSlot
from engine.parallel.tensor_parallel import SINGLE_RANK, TensorParallel
from protocol import Pooling
from protocol.vision_gguf import GGUFTextModel

ProgressCallback = Callable[[float, str], None]
log = logging.getLogger(__name__)
# What --quantize may say (protocol/launch.py QUANTIZE_KINDS).
QUANTIZE_FP8 = "fp8"


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    n_params: int
    size_bytes: int  # bytes of the weights as stored on disk
    # The embedding pooling the checkpoint names itself (engine/loader/pooling.py).
    pooling: Pooling | None = None
    # A vision-language GGUF's facts that pairing it with an mmproj needs
    # (protocol/vision_gguf.py), taken from the metadata the load already read.
    gguf_text: GGUFTextModel | None = None


class Checkpoint(Protocol):
    path: Path
    config: ModelConfig
    size_bytes: int
    pooling: Pooling | None
    # Whether each expert matrix of a layer comes as one tensor over all experts.
    stacked_experts: bool
    # Whether tensors() yields the MTP head's tensors (mtp.*) or skips them.
    keep_mtp: bool

    def tensors(self) -> Iterator[tuple[str, torch.Tensor, float]]: ...


def load_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    progress: ProgressCallback | None = None,
    host_expert_layers: int = 0,
    with_mtp: bool = False,
    packed_quant: bool | None = None,
    quantize: str | None = None,
    gguf_packed: bool = False,
    tp: TensorParallel = SINGLE_RANK,
) -> LoadedModel:
    """Load a .gguf file, a directory with config.json + *.safetensors, or a
    directory holding exactly one .gguf. progress(fraction, message) is called
    as weights load, about every 1%, and last with 1.0. The routed experts of
    the first host_expert_layers layers (-1: all) are filled in host memory
    (build_model). Raises ValueError with what to do for unsupported or
    incomplete checkpoints. with_mtp: with the checkpoint's MTP head
    (engine/models/mtp_head.py), for --spec mtp. packed_quant: keep a GGUF's
    quantized matrices in their blocks, an FP8 checkpoint's in FP8
    (engine/loader/packing.py); None: an FP8 checkpoint's where our kernels
    serve them (bf16 on a GPU with kernels/fp8_linear.py), a GGUF's there
    with gguf_packed (--gguf-weights packed: kernels/gguf_quant.py).
    quantize "fp8": quantize a float checkpoint's projections to FP8 at load
    (our kernels only). An FP8 checkpoint keeps its FP8 matrices in FP8 where
    our kernels run (kernels/fp8_linear.py) and is dequantized elsewhere.
    tp: load one tensor-parallel rank's share (float weights only for now);
    the LoadedModel's config is then the rank's view (fewer heads)."""
    checkpoint = open_checkpoint(Path(path))
    pack = _keeps_packed(checkpoint, device, dtype, packed_quant, gguf_packed)
    fp8 = _fp8_slots(checkpoint, device, dtype, quantize, packed_quant)
    if tp.world_size > 1 and (pack or fp8 is not None):
        kind = ("quantized GGUF blocks (--gguf-weights packed)" if pack
                else "FP8 weights (an FP8 checkpoint on our kernels, or --quantize fp8)")
        raise ValueError(f"{checkpoint.path.name}: tensor parallelism splits float weights "
                         f"only for now, not {kind}; load it dequantized, or on one device")
    # A packed load allocates the float weights only once it knows which it fills.
    with deferred_weights() if pack or fp8 is not None else nullcontext():
        model = build_model(checkpoint.config, device, dtype, host_expert_layers, with_mtp,
                            tp=tp)
    plan = None
    if isinstance(checkpoint, GGUFCheckpoint) and pack:
        plan = plan_packing(model, checkpoint.stacked_experts, checkpoint.packable_tensors(),
                            device)
        checkpoint.packed_names = plan.packed_names
        log_packing(checkpoint.path.name, plan, checkpoint.quantized_types())
    elif isinstance(checkpoint, HFCheckpoint) and fp8 is not None:
        plan = plan_fp8(model, checkpoint.stacked_experts, fp8, device)
        checkpoint.fp8_kept = plan.packed_names & checkpoint.fp8_tensors()
        log.info("%s: %d tensors in FP8 on the device (%s)", checkpoint.path.name,
                 len(plan.targets), "quantized at load" if quantize else "as stored")
    # The loaders skip a checkpoint's MTP head unless it is asked for.
    checkpoint.keep_mtp = with_mtp
    report = _Throttled(progress)
    report(0.0)
    _fill_weights(model, checkpoint, report, plan)
    report(1.0)
    n_params = (sum(p.numel() for p in model.parameters())
                + sum(w.shape.numel() for w in quantized_weights(model)))
    gguf_text = (GGUFTextModel.from_metadata(checkpoint.metadata(), checkpoint.path.name)
                 if isinstance(checkpoint, GGUFCheckpoint) and checkpoint.config.mrope_section
                 else None)
    # model.config: the checkpoint's, or under tensor parallelism the rank's view.
    return LoadedModel(model.config, model, n_params, checkpoint.size_bytes,
                       checkpoint.pooling, gguf_text)


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
    # A vision projector beside the model (llama.cpp's mmproj*.gguf) is not the model.
    ggufs = sorted(p for p in path.glob("*.gguf") if "mmproj" not in p.name)
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


def _keeps_packed(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                  packed_quant: bool | None, gguf_packed: bool) -> bool:
    if not isinstance(checkpoint, GGUFCheckpoint):
        return False
    if packed_quant is not None:
        return packed_quant
    if not gguf_packed:
        # NOTE: the packed kernels are slower than bf16 for now (at batch 1
        # for Q8_0, at every batch above 16 rows: docs/performance.md), so
        # packing is the operator's choice of memory over speed.
        return False
    if not (kernels_usable(device, dtype, checkpoint.config) and packed_kernels_available()):
        raise ValueError("--gguf-weights packed is served by our CUDA kernels: a bfloat16 model "
                         f"on an NVIDIA GPU with CuPy (this engine runs {dtype} on {device}); "
                         "drop the option to load the file dequantized")
    return True


def _fp8_slots(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
               quantize: str | None, packed_quant: bool | None) -> Callable[[str], bool] | None:
    """Which checkpoint tensors fill FP8 slots (None: no FP8 load): an FP8
    checkpoint's FP8 tensors where our kernels run; with --quantize fp8,
    every projection but lm_head (kept in the model dtype, as vLLM does:
    the logits are the most sensitive product). packed_quant forces FP8
    slots on (tests run them on the reference ops) or off."""
    runs = (packed_quant if packed_quant is not None
            else kernels_usable(device, dtype, checkpoint.config) and fp8_kernels_available())
    if quantize is not None and quantize != QUANTIZE_FP8:
        raise ValueError(f"--quantize {quantize!r} is not supported; only fp8 is")
    if quantize and isinstance(checkpoint, GGUFCheckpoint):
        raise ValueError(f"--quantize fp8 quantizes a Hugging Face checkpoint's float weights; "
                         f"{checkpoint.path.name} is a GGUF file, served in its own types")
    if quantize and not runs:
        raise ValueError("--quantize fp8 needs our CUDA kernels: a bfloat16 model on an NVIDIA "
                         f"GPU (this engine runs {dtype} on {device})")
    stored = checkpoint.fp8_tensors() if isinstance(checkpoint, HFCheckpoint) else frozenset()
    if stored:
        if quantize:
            log.info("%s is an FP8 checkpoint: --quantize fp8 keeps its own FP8 tensors",
                     checkpoint.path.name)
        return stored.__contains__ if runs else None
    if quantize:
        return lambda name: name != "lm_head.weight"
    return None


def _fill_weights(model: CausalLM, checkpoint: Checkpoint, report: _Throttled,
                  plan: PackingPlan | None = None) -> None:
    destinations = (plan.destinations if plan is not None
                    else model.weight_destinations(stacked_experts=checkpoint.stacked_experts))
    with torch.no_grad():
        for name, tensor, fraction in checkpoint.tensors():
            dest = destinations.pop(name, None)
            if dest is None:
                raise ValueError(
                    f"{checkpoint.path.name}: unexpected tensor {name!r} for "
                    f"{checkpoint.config.architecture}; the checkpoint does not match its config"
                )
            expected = (dest.checkpoint_shape if isinstance(dest, ShardedSlot)
                        else tuple(dest.shape))
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"{checkpoint.path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the config implies {expected}"
                )
            if plan is not None and name in plan.targets:
                # GGUF blocks, FP8 values, or a float tensor to quantize to FP8.
                plan.fill(name, tensor)
            elif isinstance(dest, ShardedSlot):
                dest.fill(tensor)  # this tensor-parallel rank's part of it
            else:
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
