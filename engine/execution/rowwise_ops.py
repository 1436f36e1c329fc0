"""The torch reference ops one token row at a time: batch-invariant mode
(--deterministic) wherever our CUDA kernels do not run (the CPU path, and a
GPU model whose dtype or head size they are not built for).

torch's own kernels pick their blocking, vector and scalar paths and thread
split from the shapes they are given (a matrix product of 1 row is a GEMV,
of 9 rows a GEMM; an elementwise op's vector tail falls where the flat size
says), so a row's bits may depend on how many rows share the call. Here
every op that reads a row (projections, norms, SwiGLU, attention) runs on
that row alone, copied to a fresh tensor (the same alignment each time), so
it sees the same shapes whatever the batch is. Each token is also its own
attention row (engine/execution/step_inputs.py lays every step out so in
this mode), so a prompt token is computed as a decode step computes it.
Slow (a Python loop per row per op): meant for tests and small models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.fp8_weight import Fp8Weight
from engine.execution.model_ops import KVCache, ReferenceOps
from engine.execution.quantized_weight import QuantizedWeight
from kernels import reference

if TYPE_CHECKING:
    from engine.models.config import ModelConfig


def _per_row(op: Callable[..., torch.Tensor], *rows_of: torch.Tensor) -> torch.Tensor:
    """op applied to each row of the [T, ...] tensors alone (fresh copies),
    the results stacked back into [T, ...]."""
    tokens = rows_of[0].shape[0]
    if tokens == 0:
        return op(*rows_of)
    return torch.cat([op(*(t[i:i + 1].clone() for t in rows_of)) for i in range(tokens)])


class RowwiseOps(ReferenceOps):
    name = "reference-rowwise"
    deterministic = True

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | Fp8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        matrix = (weight.dequantize(x.dtype) if isinstance(weight, (QuantizedWeight, Fp8Weight))
                  else weight)
        return _per_row(lambda row: F.linear(row, matrix, bias), x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _per_row(lambda row: reference.rms_norm(row, weight, eps), x)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # An elementwise sum rounds each element once, whatever the batch.
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return _per_row(reference.silu_and_mul, x)

    def attention(
        self,
        config: ModelConfig,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rope_cache: torch.Tensor | None,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
    ) -> torch.Tensor:
        """Each row writes its K/V and attends on its own, in row order: a
        prompt's rows come in order, so a row finds the K/V of the tokens
        before it written."""
        if meta.max_query_len != 1:
            raise RuntimeError("batch-invariant ops need every token as its own attention row "
                               "(step_inputs.as_decode_rows)")
        rows = []
        for i in range(qkv.shape[0]):
            row_meta = dataclasses.replace(
                meta, slot_mapping=meta.slot_mapping[i:i + 1],
                block_tables=meta.block_tables[i:i + 1], seq_lens=meta.seq_lens[i:i + 1],
                query_start_loc=meta.query_start_loc[:2], query_start_loc_host=(0, 1),
                seq_lens_host=(meta.seq_lens_host[i],), max_seq_len=meta.seq_lens_host[i])
            rows.append(super().attention(config, qkv[i:i + 1].clone(), positions[i:i + 1],
                                          row_meta, kv_cache, rope_cache, q_norm_weight,
                                          k_norm_weight))
        if not rows:
            return super().attention(config, qkv, positions, meta, kv_cache, rope_cache,
                                     q_norm_weight, k_norm_weight)
        return torch.cat(rows)


ROWWISE_OPS = RowwiseOps()
