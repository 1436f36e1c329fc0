"""Undo llama.cpp's converter for the hybrid Qwen models (GGUF qwen3next, qwen35, qwen35moe).

convert_hf_to_gguf.py changes these models' tensors beyond renaming them; each
change is inverted here so the tensors land in the HF-named slots of
engine/models/qwen3_next.py as the safetensors checkpoint would fill them:

- zero-centred RMSNorm weights (attn_norm, post_attention_norm, output_norm,
  attn_q_norm, attn_k_norm) are stored as w + 1; the Gated DeltaNet's own
  norm (ssm_norm) is not zero-centred and is stored as is;
- ssm_a holds -exp(A_log);
- ssm_conv1d drops the conv weight's middle axis of 1: [C, K] for [C, 1, K];
- ssm_dt.bias is dt_bias;
- qwen3next: in_proj_qkvz (q, k, v, z rows per key head) becomes attn_qkv
  (all q rows, all k rows, all v rows) and attn_gate (all z rows);
  in_proj_ba is ssm_ba unchanged; post_attention_layernorm is
  post_attention_norm (not ffn_norm) in every hybrid file;
- qwen35 / qwen35moe: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a are
  attn_qkv, attn_gate, ssm_beta, ssm_alpha, and where a key head has several
  value heads every per-value-head axis (the v rows of attn_qkv, the conv's v
  channels, attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt, ssm_out's columns)
  is reordered from grouped by key head (k0v0, k0v1, k1v0, k1v1) to tiled
  (k0v0, k1v0, k0v1, k1v1) for ggml's broadcast;
- blocks past block_count - nextn_predict_layers are the MTP head: skipped,
  or with keep_mtp (--spec mtp) read as mtp.layers.<i>.*, their nextn.eh_proj
  as mtp.fc, nextn.enorm / nextn.hnorm / nextn.shared_head_norm (stored w + 1,
  like the other zero-centred norms) as mtp.pre_fc_norm_embedding /
  mtp.pre_fc_norm_hidden / mtp.norm; nextn.embed_tokens and
  nextn.shared_head_head, where a file has them, repeat the model's own.

Everything else (attention projections, whose q rows keep the query/gate
interleave, experts, shared expert) is named as for the other architectures.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import numpy as np

from engine.models.config import LinearAttentionConfig, ModelConfig

log = logging.getLogger(__name__)

GROUPED_ARCHITECTURE = "qwen3next"
TILED_ARCHITECTURES = frozenset({"qwen35", "qwen35moe"})
HYBRID_ARCHITECTURES = TILED_ARCHITECTURES | {GROUPED_ARCHITECTURE}

# blk.<layer>.<kind>[.weight|.bias]: ssm_a (like Mamba's) has no suffix; MTP
# blocks also hold nextn.* kinds.
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+?)(\.weight|\.bias)?")
# Stored as w + 1 (their HF modules scale by 1 + w).
_ZERO_CENTRED_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# The MTP block's own tensors, stored w + 1 but for eh_proj (fc).
_MTP_TENSORS = {
    "nextn.eh_proj": ("mtp.fc.weight", 0.0),
    "nextn.enorm": ("mtp.pre_fc_norm_embedding.weight", 1.0),
    "nextn.hnorm": ("mtp.pre_fc_norm_hidden.weight", 1.0),
    "nextn.shared_head_norm": ("mtp.norm.weight", 1.0),
}
_MTP_SHARED = frozenset({"nextn.embed_tokens", "nextn.shared_head_head"})
_LINEAR_ATTENTION = {
    "ssm_a": "A_log",
    "ssm_conv1d": "conv1d.weight",
    "ssm_dt": "dt_bias",
    "ssm_norm": "norm.weight",
    "ssm_out": "out_proj.weight",
    "ssm_ba": "in_proj_ba.weight",
    "ssm_beta": "in_proj_b.weight",
    "ssm_alpha": "in_proj_a.weight",
    "attn_gate": "in_proj_z.weight",
    "attn_qkv": "in_proj_qkv.weight",
}


class HybridTensors:
    """Turns one hybrid GGUF file's tensors back into HF-named, HF-laid-out arrays.

    restore() takes the file's tensors in order; other_name maps the names
    that need nothing but a rename (gguf_weights.hf_name). Qwen3-Next's
    attn_qkv and attn_gate make one HF tensor, so the first of a pair is held
    until its partner arrives (the converter writes them one after the other).
    """

    def __init__(self, config: ModelConfig, architecture: str,
                 other_name: Callable[[str], str], block_count: int) -> None:
        assert architecture in HYBRID_ARCHITECTURES and config.linear_attention is not None
        self.dims: LinearAttentionConfig = config.linear_attention
        self.num_layers = config.num_layers
        self.tiled = architecture in TILED_ARCHITECTURES
        self.other_name = other_name
        self._pending: dict[tuple[str, str], np.ndarray] = {}
        self.architecture = architecture
        self.block_count = block_count
        # Set by the checkpoint before reading: read the MTP head (--spec mtp).
        self.keep_mtp = False

    def log_mtp(self) -> None:
        if self.block_count > self.num_layers and not self.keep_mtp:
            blocks = ", ".join(f"blk.{b}" for b in range(self.num_layers, self.block_count))
            log.info("%s: skipping the MTP (next-token prediction) head %s (drafts only with "
                     "--spec mtp)", self.architecture, blocks)

    def restore(self, gguf_name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """(HF name, array) pairs for one GGUF tensor: none for a skipped MTP
        tensor or the first half of a qkv/gate pair."""
        if gguf_name == "output_norm.weight":
            return [("model.norm.weight", array - 1)]
        match = _BLOCK_TENSOR.fullmatch(gguf_name)
        if match is None:
            return [(self.other_name(gguf_name), array)]
        layer, kind, _ = match.groups()
        if int(layer) >= self.num_layers:
            return self._mtp_tensor(int(layer) - self.num_layers, gguf_name, kind, array)
        prefix = f"model.layers.{layer}"
        if kind in _ZERO_CENTRED_NORMS:
            return [(f"{prefix}.{_ZERO_CENTRED_NORMS[kind]}.weight", array - 1)]
        if kind not in _LINEAR_ATTENTION:
            return [(self.other_name(gguf_name), array)]
        if not self.tiled and kind in ("attn_qkv", "attn_gate"):
            return self._pair_qkvz(layer, kind, array)
        array = self._linear_attention_array(kind, array)
        return [(f"{prefix}.linear_attn.{_LINEAR_ATTENTION[kind]}", array)]

    def _mtp_tensor(self, index: int, gguf_name: str, kind: str, array: np.ndarray
                    ) -> list[tuple[str, np.ndarray]]:
        """An MTP block's tensor under its HF name (none unless keep_mtp)."""
        if not self.keep_mtp or kind in _MTP_SHARED:
            return []
        if kind in _MTP_TENSORS:
            name, offset = _MTP_TENSORS[kind]
            return [(name, array - offset if offset else array)]
        # The block's attention and MLP tensors, named as a decoder layer's.
        restored = self.restore(gguf_name.replace(f"blk.{index + self.num_layers}.", "blk.0.", 1),
                                array)
        return [(name.replace("model.layers.0.", f"mtp.layers.{index}.", 1), value)
                for name, value in restored]

    def renamed(self, gguf_name: str) -> str | None:
        """The HF name of a tensor that restore() hands on unchanged (so its
        quantized blocks can be kept as they are: engine/loader/packing.py);
        None for one it transforms or skips."""
        match = _BLOCK_TENSOR.fullmatch(gguf_name)
        if match is None:
            return None if gguf_name == "output_norm.weight" else self.other_name(gguf_name)
        layer, kind, _ = match.groups()
        if int(layer) >= self.num_layers or kind in _ZERO_CENTRED_NORMS:
            return None
        if kind not in _LINEAR_ATTENTION:
            return self.other_name(gguf_name)
        # Qwen3-Next's output and b/a projections pass as stored; Qwen3.5
        # reorders value heads and Qwen3-Next regroups q/k/v/z.
        if self.tiled or kind not in ("ssm_out", "ssm_ba"):
            return None
        return f"model.layers.{layer}.linear_attn.{_LINEAR_ATTENTION[kind]}"

    def check_complete(self) -> None:
        if self._pending:
            layer, kind = next(iter(self._pending))
            partner = "attn_gate" if kind == "attn_qkv" else "attn_qkv"
            raise ValueError(f"GGUF blk.{layer}.{kind} has no blk.{layer}.{partner} to make "
                             "in_proj_qkvz with; the file is incomplete")

    def _linear_attention_array(self, kind: str, array: np.ndarray) -> np.ndarray:
        if kind == "ssm_a":
            array = np.log(-array)
        if self.tiled:
            array = self._untile(kind, array)
        if kind == "ssm_conv1d":
            array = array.reshape(array.shape[0], 1, array.shape[-1])
        return np.ascontiguousarray(array)

    def _untile(self, kind: str, array: np.ndarray) -> np.ndarray:
        """Undo the converter's grouped -> tiled value-head reorder."""
        dims = self.dims
        if kind in ("attn_qkv", "ssm_conv1d"):
            # Only the v rows (channels) follow q and k; those move.
            qk = 2 * dims.key_size
            return np.concatenate([array[:qk], self._grouped(array[qk:], dims.value_head_dim)])
        if kind == "attn_gate":
            return self._grouped(array, dims.value_head_dim)
        if kind in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
            return self._grouped(array, 1)
        if kind == "ssm_out":
            return self._grouped(array.T, dims.value_head_dim).T
        return array  # ssm_norm: one value head's width, shared by all

    def _grouped(self, rows: np.ndarray, head_dim: int) -> np.ndarray:
        """Rows in tiled value-head order (value head j of key head k at
        j * key_heads + k) back in grouped order (at k * per_key + j)."""
        dims = self.dims
        per_key = dims.num_value_heads // dims.num_key_heads
        tiled = rows.reshape(per_key, dims.num_key_heads, head_dim, *rows.shape[1:])
        return tiled.swapaxes(0, 1).reshape(rows.shape)

    def _pair_qkvz(self, layer: str, kind: str,
                   array: np.ndarray) -> list[tuple[str, np.ndarray]]:
        partner = "attn_gate" if kind == "attn_qkv" else "attn_qkv"
        other = self._pending.pop((layer, partner), None)
        if other is None:
            self._pending[(layer, kind)] = array
            return []
        qkv, z = (array, other) if kind == "attn_qkv" else (other, array)
        return [(f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight", self._qkvz(qkv, z))]

    def _qkvz(self, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
        """attn_qkv (q | k | v, each over all key heads) and attn_gate (z)
        regrouped per key head: q_h, k_h, v_h, z_h for each key head h."""
        dims = self.dims
        heads, hidden = dims.num_key_heads, qkv.shape[-1]
        q, k, v = np.split(qkv, [dims.key_size, 2 * dims.key_size])
        per_head = [part.reshape(heads, -1, hidden) for part in (q, k, v, z)]
        return np.concatenate(per_head, axis=1).reshape(-1, hidden)
