"""Which weights of a GGUF load stay in their quantized blocks (issue 19).

On a GPU running our kernels, a matrix that ops.linear multiplies by (the
slots a module lists in linear_weights: qkv, o, gate_up, down, lm_head, the
hybrid layers' projections) is kept packed when every checkpoint tensor that
fills it is of a type the packed kernels read (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K)
and reaches it unchanged but for a row order (llama.cpp's q/k permutation:
rows of blocks move as rows). A QuantizedWeight takes the slot's place, one
segment per tensor, so a fused qkv may mix Q4_K and Q6_K. Everything else
(embeddings, norms, biases, experts, F32/F16 tensors, other quantized types,
tensors a hybrid model's loader transforms) is dequantized as before.

An FP8 load (a Hugging Face FP8 checkpoint, or --quantize fp8) puts an
Fp8Weight in each linear slot the same way (plan_fp8).

The model is built with its weights deferred (engine/models/weight_alloc.py):
the float matrices of packed slots are never allocated, so the device peaks
at about the file's bytes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine.execution.fp8_weight import Fp8Rows, Fp8Weight
from engine.execution.quantized_weight import PACKED_TYPES, QuantizedWeight
from kernels.fp8_linear import fp8_shape_supported
from kernels.gguf_reference import BLOCK_SIZES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedRows:
    """A checkpoint tensor's GGUF blocks, rows in the HF order: uint8
    [rows, row_bytes] for a float matrix [rows, k]."""

    qtype: int
    k: int
    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.k)


@dataclass
class PackingPlan:
    """The fill of a packed load: every weight slot by HF name (row slices of
    packed slots are meta tensors, for the shape check), and where each packed
    tensor's blocks go (its QuantizedWeight and segment)."""

    destinations: dict[str, torch.Tensor]
    targets: dict[str, tuple[QuantizedWeight | Fp8Weight, int]] = field(default_factory=dict)

    @property
    def packed_names(self) -> frozenset[str]:
        return frozenset(self.targets)

    def fill(self, name: str, rows: PackedRows | Fp8Rows | torch.Tensor) -> None:
        """Fill the segment of a packed tensor's blocks, or of an FP8 slot's
        tensor (a float one is quantized: --quantize fp8)."""
        weight, index = self.targets[name]
        if isinstance(weight, Fp8Weight):
            assert not isinstance(rows, PackedRows), "GGUF blocks never fill an FP8 slot"
            weight.fill_segment(index, rows)
        else:
            assert isinstance(rows, PackedRows), "a packed slot is filled with its blocks"
            getattr(weight, f"packed{index}").copy_(rows.data)


def plan_packing(model: nn.Module, stacked_experts: bool,
                 packable: dict[str, tuple[int, tuple[int, int]]],
                 device: torch.device) -> PackingPlan:
    """Put a QuantizedWeight in each linear slot whose tensors are all in
    packable (HF name -> (GGUF type, HF shape)) and allocate every other
    deferred weight on device. model was built inside deferred_weights()."""
    slots, parts = _slot_parts(model, stacked_experts)
    chosen = {key: found for key, found in parts.items()
              if _packs(slots[key][2], found, packable)}
    _allocate_deferred(model, device, skip={id(slots[key][2]) for key in chosen})
    plan = PackingPlan(model.weight_destinations(stacked_experts=stacked_experts))
    for key, segments in chosen.items():
        module, attr, param = slots[key]
        weight = QuantizedWeight([(rows, packable[name][0]) for _, rows, name in segments],
                                 param.shape[1], device)
        delattr(module, attr)
        setattr(module, attr, weight)
        for index, (_, _, name) in enumerate(segments):
            plan.targets[name] = (weight, index)
    return plan


def plan_fp8(model: nn.Module, stacked_experts: bool, fp8: Callable[[str], bool],
             device: torch.device) -> PackingPlan:
    """Put an Fp8Weight in each linear slot whose tensors all pass fp8 (an
    FP8 checkpoint's FP8 tensors; with --quantize fp8, the tensors to
    quantize) and whose K the kernels take; allocate every other deferred
    weight on device. model was built inside deferred_weights()."""
    slots, parts = _slot_parts(model, stacked_experts)
    chosen = {key: found for key, found in parts.items()
              if _covers(slots[key][2], found) and fp8_shape_supported(*slots[key][2].shape)
              and all(fp8(name) for _, _, name in found)}
    _allocate_deferred(model, device, skip={id(slots[key][2]) for key in chosen})
    plan = PackingPlan(model.weight_destinations(stacked_experts=stacked_experts))
    for key, segments in chosen.items():
        module, attr, param = slots[key]
        weight = Fp8Weight([rows for _, rows, _ in segments], param.shape[1], device)
        delattr(module, attr)
        setattr(module, attr, weight)
        for index, (_, _, name) in enumerate(segments):
            plan.targets[name] = (weight, index)
    return plan


def _slot_parts(model: nn.Module, stacked_experts: bool) -> tuple[
        dict[int, tuple[nn.Module, str, nn.Parameter]], dict[int, list[tuple[int, int, str]]]]:
    """The linear slots (_linear_slots) and the checkpoint tensors that fill
    each: (first row, rows, HF name), top to bottom."""
    slots = _linear_slots(model)
    parts: dict[int, list[tuple[int, int, str]]] = {key: [] for key in slots}
    for name, dest in model.weight_destinations(stacked_experts=stacked_experts).items():
        base = dest if dest._base is None else dest._base
        if id(base) in slots and dest.dim() == 2:
            parts[id(base)].append((dest.storage_offset() // base.stride(0), dest.shape[0], name))
    return slots, {key: sorted(found) for key, found in parts.items()}


def _covers(param: nn.Parameter, segments: list[tuple[int, int, str]]) -> bool:
    """Whether the segments fill the slot's rows one after another."""
    expected = 0
    for start, count, _ in segments:
        if start != expected:
            return False
        expected += count
    return expected == param.shape[0] and expected > 0


def _linear_slots(model: nn.Module) -> dict[int, tuple[nn.Module, str, nn.Parameter]]:
    """id(parameter) -> (module, attribute, parameter) of every slot a module
    lists in linear_weights; a tied lm_head (the embedding table) is none."""
    embedding = getattr(model, "embed_tokens", None)
    slots = {}
    for module in model.modules():
        for attr in getattr(type(module), "linear_weights", ()):
            param = module._parameters.get(attr)
            if param is not None and param is not embedding and param.dim() == 2:
                slots[id(param)] = (module, attr, param)
    return slots


def _packs(param: nn.Parameter, segments: list[tuple[int, int, str]],
           packable: dict[str, tuple[int, tuple[int, int]]]) -> bool:
    """Whether the slot's tensors cover its rows and all come packable."""
    rows, k = param.shape
    expected = 0
    for start, count, name in segments:
        found = packable.get(name)
        if start != expected or found is None or found[1] != (count, k):
            return False
        if k % BLOCK_SIZES[found[0]][0]:
            return False
        expected += count
    return expected == rows and expected > 0


def _allocate_deferred(model: nn.Module, device: torch.device, skip: set[int]) -> None:
    """A device tensor for each meta parameter not in skip, put in every
    module that holds it (a tied lm_head is the embedding's parameter)."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is None or not param.is_meta or id(param) in skip:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=False)
            module._parameters[attr] = replaced[id(param)]


def log_packing(path_name: str, plan: PackingPlan,
                quantized: dict[str, int]) -> None:
    """One line: what was packed (count, bytes, types) and which quantized
    types (and how many tensors) were dequantized instead. quantized: HF name
    -> GGUF type id of every quantized tensor the file fills."""
    weights = {id(w): w for w, _ in plan.targets.values()}.values()
    nbytes = sum(w.nbytes for w in weights)
    packed_types = Counter(_type_name(quantized[name]) for name in plan.targets)
    left = Counter(_type_name(qtype) for name, qtype in quantized.items()
                   if name not in plan.targets)
    log.info("%s: %d quantized tensors kept packed on the device (%s; %.1f MiB); "
             "dequantized: %s", path_name, len(plan.targets),
             ", ".join(f"{t} {n}" for t, n in sorted(packed_types.items())) or "none",
             nbytes / 2**20,
             ", ".join(f"{t} {n}" for t, n in sorted(left.items())) or "none")


def _type_name(qtype: int) -> str:
    return GGMLQuantizationType(qtype).name


__all__ = ["PACKED_TYPES", "PackedRows", "PackingPlan", "log_packing", "plan_fp8",
           "plan_packing"]
