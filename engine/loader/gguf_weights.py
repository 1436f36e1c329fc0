"""Weights from a GGUF file (llama.cpp's format), dequantized to HF-layout tensors
(or, for the matrices a load keeps packed, their blocks: engine/loader/packing.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.loader.gguf_file import GGUFFile, GGUFTensor, open_gguf
from engine.loader.gguf_hybrid import HYBRID_ARCHITECTURES, HybridTensors
from engine.loader.packing import PACKED_TYPES, PackedRows
from engine.loader.pooling import gguf_pooling
from engine.models import model_class
from engine.models.config import ModelConfig
from engine.models.moe import ExpertTensorNames

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Qwen2-MoE's shared expert and its sigmoid gate.
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Mixture-of-experts tensors: the router, and each expert matrix either stacked
# over the experts ([E, rows, cols]) or, in old Mixtral files, one per expert.
_ROUTER = "ffn_gate_inp"
_STACKED_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Tensors that ModelConfig.from_gguf reads as settings rather than weights.
_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
_PLAIN_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
_FLOAT_TYPES = frozenset({*_PLAIN_TYPES, GGMLQuantizationType.BF16, GGMLQuantizationType.F64})


class GGUFCheckpoint:
    """One .gguf file: its ModelConfig and its tensors under Hugging Face names."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.file: GGUFFile = open_gguf(path)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None
        self.config = ModelConfig.from_gguf(self.file)
        self.size_bytes = path.stat().st_size
        meta = self.file.metadata
        self.pooling = gguf_pooling(meta.arch_value("pooling_type"))
        cls = model_class(self.config.architecture)
        self._unpermute_qk = cls.gguf_permuted_qk
        self._expert_names = cls.expert_tensor_names
        arch = meta.architecture
        # The hybrid Qwen models' converter transforms tensors beyond renaming them.
        self._hybrid = (HybridTensors(self.config, arch, self._hf_name,
                                      int(meta.arch_value("block_count")))
                        if arch in HYBRID_ARCHITECTURES else None)
        # llama.cpp's converter stacks the experts; old Mixtral files list them one by one.
        self.stacked_experts = any(
            t.name.split(".")[-2] in _STACKED_EXPERTS for t in self.file.tensors
        )
        _check_tensor_types(self.file.tensors, path)
        # Only hybrid files carry an MTP head we read (load_model sets this).
        self.keep_mtp = False
        # The tensors yielded as their blocks (PackedRows), by HF name
        # (load_model sets this from engine/loader/packing.py's plan).
        self.packed_names: frozenset[str] = frozenset()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor, float]]:
        """(HF name, float CPU tensor shaped like the HF weight, fraction of bytes read)."""
        total = sum(t.n_bytes for t in self.file.tensors) or 1
        done = 0
        if self._hybrid is not None:
            self._hybrid.keep_mtp = self.keep_mtp
            self._hybrid.log_mtp()
        for tensor in self.file.tensors:
            done += tensor.n_bytes
            if tensor.name in _CONFIG_TENSORS:
                continue
            packed = self._packed_rows(tensor)
            if packed is not None:
                yield packed[0], packed[1], done / total  # type: ignore[misc]
                continue
            array = tensor_array(tensor)
            restored = (self._hybrid.restore(tensor.name, array) if self._hybrid is not None
                        else [(self._hf_name(tensor.name), array)])
            for name, array in restored:
                if name.endswith("shared_expert_gate.weight") and array.ndim == 1:
                    # The converter squeezes HF's [1, H] gate to a vector.
                    array = array[None]
                yield name, torch.from_numpy(self._hf_row_order(name, array)), done / total
        if self._hybrid is not None:
            self._hybrid.check_complete()

    def metadata(self) -> Mapping[str, Any]:
        """The file's key-value metadata, as plain values (protocol/gguf_file.py)."""
        return self.file.metadata

    def _hf_row_order(self, name: str, array: np.ndarray) -> np.ndarray:
        """Undo the converter's q/k row permutation where it made one (rows
        of quantized blocks move as float rows would)."""
        if self._unpermute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_rows(array, self.config.num_heads)
        if self._unpermute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute_rows(array, self.config.num_kv_heads)
        return array

    def _hf_name(self, gguf_name: str) -> str:
        return hf_name(gguf_name, self._expert_names)

    def _renamed(self, tensor: GGUFTensor) -> str | None:
        """The HF name of a tensor that loading only renames (and maybe
        reorders by rows); None for one it transforms or skips."""
        try:
            if self._hybrid is not None:
                return self._hybrid.renamed(tensor.name)
            return self._hf_name(tensor.name)
        except ValueError:
            return None

    def packable_tensors(self) -> dict[str, tuple[int, tuple[int, int]]]:
        """HF name -> (GGUF type id, HF shape) of the matrices whose blocks
        could be kept packed (engine/loader/packing.py)."""
        found = {}
        for tensor in self.file.tensors:
            if tensor.tensor_type not in PACKED_TYPES or len(tensor.shape) != 2:
                continue
            name = self._renamed(tensor)
            if name is not None:
                k, rows = tensor.shape  # GGUF lists the innermost first
                found[name] = (int(tensor.tensor_type), (rows, k))
        return found

    def quantized_types(self) -> dict[str, int]:
        """Name (HF where loading only renames it, else GGUF) -> GGUF type id
        of every quantized tensor, for the load's log line."""
        return {self._renamed(t) or t.name: int(t.tensor_type) for t in self.file.tensors
                if t.tensor_type not in _FLOAT_TYPES and t.name not in _CONFIG_TENSORS}

    def _packed_rows(self, tensor: GGUFTensor) -> tuple[str, PackedRows] | None:
        """The tensor's blocks, for a tensor the load keeps packed."""
        if not self.packed_names or tensor.tensor_type not in PACKED_TYPES:
            return None
        name = self._renamed(tensor)
        if name is None or name not in self.packed_names:
            return None
        # One tensor-sized copy out of the read-only memory map.
        rows = np.array(self._hf_row_order(name, tensor.data), dtype=np.uint8, copy=True)
        return name, PackedRows(int(tensor.tensor_type), tensor.shape[0],
                                torch.from_numpy(rows))


def hf_name(gguf_name: str, experts: ExpertTensorNames | None = None) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for unknown tensors.

    Expert tensors need the architecture's expert names; a stacked one
    (ffn_gate_exps) is named <block>.experts.<gate>.weight, the slot that
    SparseMoE.stacked_weight_destinations gives it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    unknown = ValueError(f"GGUF tensor {gguf_name!r} has no place in the supported architectures")
    match = _EXPERT_TENSOR.fullmatch(gguf_name)
    if match is not None:
        if experts is None:
            raise unknown
        layer, matrix, expert = match.groups()
        return (f"model.layers.{layer}.{experts.block}.experts.{expert}."
                f"{getattr(experts, matrix)}.weight")
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None:
        raise unknown
    layer, kind, suffix = match.groups()
    if kind in _BLOCK_NAMES:
        return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
    if experts is None or suffix != "weight":
        raise unknown
    if kind == _ROUTER:
        return f"model.layers.{layer}.{experts.block}.{experts.router}.weight"
    if kind in _STACKED_EXPERTS:
        matrix = getattr(experts, _STACKED_EXPERTS[kind])
        return f"model.layers.{layer}.{experts.block}.experts.{matrix}.weight"
    raise unknown


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's q/k row permutation (weights or biases).

    Per head, the converter moved rotate_half's pairs (i, i + D/2) next to
    each other; reading the rows as (head, D/2, 2) and swapping the last two
    axes restores the HF order.
    """
    half = weight.shape[0] // num_heads // 2
    restored = weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(2, 1)
    return np.ascontiguousarray(restored.reshape(weight.shape))


def tensor_array(tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as a writable float array (F16 kept, others dequantized)."""
    if tensor.tensor_type == GGMLQuantizationType.F16:
        # Kept in float16: the copy into the model converts, with no float32 detour.
        array = tensor.data
    else:
        array = dequantize(tensor.data, tensor.tensor_type)
    # Plain types come back as views of the read-only memory map; torch needs
    # a writable array, and one tensor-sized copy at a time is cheap.
    return np.require(array, requirements=("C", "W"))


def _check_tensor_types(tensors: tuple[GGUFTensor, ...], path: Path) -> None:
    for qtype in {t.tensor_type for t in tensors}:
        if not _can_dequantize(qtype):
            names = [t.name for t in tensors if t.tensor_type == qtype][:3]
            raise ValueError(
                f"{path.name}: GGUF tensor type {qtype.name} (e.g. {', '.join(names)}) cannot be "
                "dequantized; use a file quantized as F16/BF16/Q8_0/Q4_0/Q4_1/Q5_x or a K-quant"
            )


def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    if qtype in _PLAIN_TYPES:
        return True
    if qtype not in GGML_QUANT_SIZES:
        return False
    # gguf has no public list of what it can dequantize: try one zero block.
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True
