"""The ops a decoder layer calls, in two implementations with one interface.

ReferenceOps runs kernels.reference (pure torch): the CPU path, any dtype, and
CUDA in float32/float16. CudaOps runs our CUDA kernels (bf16 on a GPU): RMSNorm
with the residual add fused in, RoPE fused with Qwen3's q/k norms and the KV
cache write, SwiGLU, and paged attention (a split-K decode kernel for decode
steps, a tensor-core prefill kernel for steps with prompt chunks), and for
hybrid models the Gated DeltaNet causal conv and delta rule, the zero-centred
RMSNorms (residual add fused), the gated output norm, the gated attention's
q/k norms + partial RoPE + cache write, and the shared expert's gated sum. GEMMs are
torch's (cuBLAS), except the projections of steps with at most 8 rows, which
a bandwidth-bound skinny GEMM kernel does (kernels/skinny_gemm.py), and the
products with GGUF matrices kept in their quantized blocks
(engine/execution/quantized_weight.py), which kernels/gguf_quant.py does, and
with FP8 matrices (engine/execution/fp8_weight.py), kernels/fp8_linear.py.

A decode step on CudaOps reads nothing on the host and allocates only torch
intermediates, so it can be captured into a CUDA graph (engine/execution/cuda_graphs.py).

Batch-invariant mode (--deterministic): CudaOps(deterministic=True) runs
every bf16 projection, lm_head included, through the skinny kernel's
batch-invariant form (kernels/skinny_gemm.py skinny_linear_rows) and all
attention through the decode kernel with one split, so each token's row has
one reduction order whatever shares its step; every step is laid out as
decode rows (engine/execution/step_inputs.py). Elsewhere RowwiseOps
(engine/execution/rowwise_ops.py) runs the reference a row at a time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.fp8_weight import Fp8Weight
from engine.execution.kv_dtype import K_SCALE, V_SCALE
from engine.execution.quantized_weight import QuantizedWeight, largest_quantized_elements
from kernels import (
    activation,
    gated_delta,
    gated_delta_chunked,
    gated_delta_reference,
    gated_delta_tc,
    hybrid_reference,
    moe,
    moe_grouped,
    moe_reference,
    norm,
    reference,
    skinny_fused,
)
from kernels.cuda_build import cuda_available
from kernels.decode_attention import decode_workspace, paged_decode_attention
from kernels.gated_norm import gated_norm_supported, gated_rms_norm
from kernels.gated_rope_cache import gated_rope_and_cache, rotary_dim_supported, sigmoid_gate_mul
from kernels.prefill_attention import paged_prefill_attention
from kernels.rope_cache import rope_and_cache
from kernels.shared_expert import combine_supported, shared_expert_combine
from kernels.skinny_gemm import skinny_linear, skinny_linear_rows, skinny_linear_supported

if TYPE_CHECKING:
    from engine.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class ReferenceOps:
    name = "reference"
    # Batch-invariant (--deterministic): every row computed alone, as a decode row.
    deterministic = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | Fp8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, (QuantizedWeight, Fp8Weight)):
            # The same float matrix a dequantizing load would hold.
            return F.linear(x, weight.dequantize(x.dtype), bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.add_rms_norm(x, residual, weight, eps)

    def zero_centred_rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> torch.Tensor:
        """Qwen3-Next's / Qwen3.5's RMSNorm: scaled by (1 + weight) in float32."""
        return hybrid_reference.zero_centred_rms_norm(x, weight, eps)

    def add_zero_centred_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(zero_centred_rms_norm(x + residual), x + residual), as add_rms_norm."""
        return hybrid_reference.add_zero_centred_rms_norm(x, residual, weight, eps)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """Gated DeltaNet's output norm: x, gate [T, Hv, Dv] (gate may be a
        strided view), weight [Dv] -> RMSNorm(x) * silu(gate), [T, Hv, Dv]."""
        return hybrid_reference.gated_rms_norm(x, gate, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x)

    # A dense decoder layer's fused form (engine/models/decoder.py): the norms
    # move into the projections after them and the residual adds into those
    # before them. Here each is its unfused chain, the same values.
    def fuses_dense_layer(self, hidden: torch.Tensor, weights: Sequence[object]) -> bool:
        """Whether a dense layer over hidden [M, H] with these projections
        runs in the fused form: only where kernels fuse it (CudaOps)."""
        return False

    def norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """linear(rms_norm(x, norm_weight, eps), weight, bias)."""
        return self.linear(self.rms_norm(x, norm_weight, eps), weight, bias)

    def norm_swiglu(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    gate_up: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(linear(rms_norm(x, norm_weight, eps), gate_up))."""
        return self.silu_and_mul(self.linear(self.rms_norm(x, norm_weight, eps), gate_up))

    def linear_add_(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        """residual += linear(x, weight, bias), in place (the projection
        rounded first, as the unfused add_rms_norm adds it); returns residual."""
        return residual.add_(self.linear(x, weight, bias))

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
        """qkv: [T, q_size + 2 * kv_size] -> attention output [T, q_size].
        rope_cache None: q and k arrive rotated already (a layer with its own
        norms or partial rotary, such as GatedAttention)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
        q = q.view(tokens, config.num_heads, config.head_dim)
        k = k.view(tokens, config.num_kv_heads, config.head_dim)
        v = v.view(tokens, config.num_kv_heads, config.head_dim)
        if q_norm_weight is not None and k_norm_weight is not None:
            q = reference.rms_norm(q, q_norm_weight, config.rms_norm_eps)
            k = reference.rms_norm(k, k_norm_weight, config.rms_norm_eps)
        if rope_cache is not None:
            q, k = reference.apply_rope(positions, q, k, rope_cache)
        k_cache, v_cache = kv_cache
        # An fp8 cache (--kv-dtype fp8) is quantized and read back with the
        # per-tensor scales of engine/execution/kv_dtype.py.
        reference.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, K_SCALE, V_SCALE)
        out = reference.paged_attention(
            q, k_cache, v_cache, meta.query_start_loc_host, meta.seq_lens_host,
            meta.block_tables, config.head_dim**-0.5, K_SCALE, V_SCALE,
        )
        return out.view(tokens, config.q_size)

    def gated_attention(
        self,
        config: ModelConfig,
        projected: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rope_cache: torch.Tensor,
        q_norm_weight: torch.Tensor,
        k_norm_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Qwen3-Next's / Qwen3.5's GatedAttention between its two projections:
        projected [T, 2 q_size + 2 kv_size] (per q head D of q, then D of gate;
        then k, v) -> attention(rope(zc_norm(q)), ...) * sigmoid(gate), [T, q_size].
        rope_cache: [max_positions, rotary_dim] (partial rotary); the q/k norms
        are zero-centred."""
        tokens = projected.shape[0]
        q, k, v = hybrid_reference.gated_qk_norm_rope(
            projected, positions, rope_cache, q_norm_weight, k_norm_weight, config.num_heads,
            config.num_kv_heads, config.head_dim, config.rms_norm_eps)
        _, gate, _, _ = hybrid_reference.split_gated_qkv(
            projected, config.num_heads, config.num_kv_heads, config.head_dim)
        # q/k are normed and rotated: the shared attention op gets no rope_cache.
        qkv = torch.cat([t.reshape(tokens, -1) for t in (q, k, v)], dim=-1)
        out = self.attention(config, qkv, positions, meta, kv_cache, None, None, None)
        return out * torch.sigmoid(gate.reshape(tokens, config.q_size))

    def moe_route(self, router_logits: torch.Tensor, top_k: int,
                  normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (float32 weights [T, k], expert ids [T, k])."""
        return moe_reference.route_topk(router_logits, top_k, normalize)

    def moe_experts(self, hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor,
                    cache: moe.ExpertCacheView | None = None) -> torch.Tensor:
        """Stacked SwiGLU experts: hidden [T, H], gate_up [E, 2I, H], down [E, H, I],
        experts/weights [T, k] -> the weighted sum of each token's experts [T, H].
        cache: device copies of some experts (a GPU's; the same values)."""
        return moe_reference.moe_experts(hidden, gate_up, down, experts.long(), weights)

    def shared_expert_combine(self, routed: torch.Tensor, shared: torch.Tensor,
                              gate_logit: torch.Tensor) -> torch.Tensor:
        """A shared-expert MoE's output: routed [T, H] + sigmoid(gate_logit [T, 1])
        * shared [T, H]."""
        return routed + torch.sigmoid(gate_logit) * shared

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Gated DeltaNet's depthwise causal conv + SiLU: x [T, C], weight [C, K],
        conv_states [S, C, K-1] (updated in the batch's state slots) -> [T, C]."""
        assert meta.state_slots is not None and meta.state_fresh is not None
        return gated_delta_reference.causal_conv1d(x, weight, bias, conv_states, meta.state_slots,
                                                   meta.state_fresh, meta.query_start_loc_host)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                         dt_bias: torch.Tensor, states: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """Gating (gdn_gating of a, b, A_log, dt_bias) and the gated delta rule:
        q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv], states [S, Hv, Dk, Dv]
        (updated in the batch's state slots) -> o [T, Hv, Dv]."""
        assert meta.state_slots is not None and meta.state_fresh is not None
        g, beta = gated_delta_reference.gdn_gating(a, b, a_log, dt_bias)
        return gated_delta_reference.gated_delta_rule(q, k, v, g, beta, states, meta.state_slots,
                                                      meta.state_fresh, meta.query_start_loc_host)


class CudaOps(ReferenceOps):
    """Our kernels. decode_batch and max_seq_len size the split-K workspace of
    the decode kernel: the most rows a decode step has, and the longest
    sequence it can see (the served context)."""

    name = "cuda"

    def __init__(self, config: ModelConfig, device: torch.device, decode_batch: int,
                 max_seq_len: int, quant_scratch_elements: int = 0,
                 deterministic: bool = False) -> None:
        """deterministic: batch-invariant mode (the module's docstring)."""
        self.device = device
        self.deterministic = deterministic
        # ROUNDHOUSE_FUSED_LAYERS=0: dense decode layers unfused (A/B runs).
        self.fuse_layers = os.environ.get("ROUNDHOUSE_FUSED_LAYERS", "1") != "0"
        # Where packed GGUF matrices are dequantized for many-row steps
        # (kernels/gguf_quant.py), shared by every layer, allocated before
        # any graph is captured; a larger matrix goes through it in chunks.
        self.quant_scratch = (
            torch.empty(min(quant_scratch_elements, QUANT_SCRATCH_MAX_ELEMENTS),
                        dtype=torch.bfloat16, device=device)
            if quant_scratch_elements else None)
        self.decode_batch = decode_batch
        self.max_seq_len = max_seq_len
        # One split per row in batch-invariant mode: no partials to hold.
        self.workspace = (None if deterministic else
                          decode_workspace(decode_batch, config.num_heads, config.head_dim,
                                           max_seq_len, device))
        # The expert GEMV's activations, allocated before any graph is captured.
        self.moe_workspace = (moe.moe_gemv_workspace(MOE_GEMV_MAX_PAIRS,
                                                     config.moe.intermediate_size, device)
                              if config.moe is not None else None)
        # Host-resident experts' stacks, one layer's at a time, for large steps.
        self.staged_experts: tuple[torch.Tensor, torch.Tensor] | None = None
        # The cos/sin table of no rotation, for attention of q/k rotated already.
        half = config.head_dim // 2
        self.identity_rope = torch.cat([torch.ones(half), torch.zeros(half)]).to(
            device=device, dtype=torch.bfloat16).view(1, config.head_dim)

    def workspace_bytes(self) -> int:
        held = vars(self.workspace) if self.workspace is not None else {}
        tensors = [t for t in held.values() if isinstance(t, torch.Tensor)]
        if self.moe_workspace is not None:
            tensors.append(self.moe_workspace)
        tensors += self.staged_experts or ()
        if self.quant_scratch is not None:
            tensors.append(self.quant_scratch)
        return sum(t.numel() * t.element_size() for t in tensors)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | Fp8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return self._quantized_linear(x, weight, bias)
        if isinstance(weight, Fp8Weight):
            return self._fp8_linear(x, weight, bias)
        if self.deterministic:
            return self._invariant_linear(x, weight, bias)
        # NOTE: for a few rows (decode) cuBLAS streams the smaller matrices at
        # 8-50% of the copy rate (bench_skinny_gemm.py); our kernel beats it
        # there. Larger batches and larger matrices stay with cuBLAS.
        if skinny_linear_supported(x, weight) and _skinny_wins(x.shape[0], weight.numel()):
            return skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _invariant_linear(self, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ weight^T with each row's bits independent of M (any M:
        prefill chunks, decode batches, lm_head rows)."""
        if x.shape[0] == 0:
            return x.new_empty((0, weight.shape[0]))
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
        return skinny_linear_rows(x, weight, bias)

    def _quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ packed weight [N, K]^T: each segment of rows writes its
        columns of one output. Many-row steps dequantize into the shared
        scratch, a chunk of rows at a time where a segment is larger."""
        from kernels import gguf_quant  # only where our GPU kernels run

        x = x.contiguous()
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        scratch = self.quant_scratch
        chunk = max(scratch.numel() // weight.k, 1) if scratch is not None else 0
        for segment in weight.segments():
            step = min(chunk or segment.rows, segment.rows)
            for first in range(0, segment.rows, step):
                rows = min(step, segment.rows - first)
                start = segment.start + first
                # NOTE: a part of the rows writes its columns of out in place
                # (a view with row stride N), so nothing is concatenated.
                columns = out if rows == out.shape[1] else out[:, start:start + rows]
                gguf_quant.quant_linear(x, segment.packed[first:first + rows], segment.qtype,
                                        weight.k, out=columns, scratch=scratch)
        if bias is not None:
            out += bias
        return out

    def _fp8_linear(self, x: torch.Tensor, weight: Fp8Weight,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ FP8 weight [N, K]^T, segment by segment into one output
        (kernels/fp8_linear.py). Many-row steps dequantize into the shared
        scratch, in chunks of whole 128-row scale blocks where a segment is
        larger."""
        from kernels import fp8_linear  # only where our GPU kernels run

        x = x.contiguous()
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        scratch = self.quant_scratch
        chunk = 0
        if scratch is not None:
            chunk = max(scratch.numel() // weight.k // FP8_CHUNK_ROWS, 1) * FP8_CHUNK_ROWS
        many = x.shape[0] > fp8_linear.FP8_GEMV_MAX_ROWS
        for segment in weight.segments():
            step = min(chunk, segment.rows) if many and chunk else segment.rows
            for first in range(0, segment.rows, step):
                rows = min(step, segment.rows - first)
                start = segment.start + first
                columns = out if rows == out.shape[1] else out[:, start:start + rows]
                scales = segment.scales[first // FP8_CHUNK_ROWS:
                                        -(-(first + rows) // FP8_CHUNK_ROWS)]
                fp8_linear.fp8_linear(x, segment.values[first:first + rows], scales,
                                      out=columns, scratch=scratch)
        if bias is not None:
            out += bias
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: the kernel writes x + residual into residual in place; the
        # residual stream is this forward pass's own tensor, never a weight.
        return norm.add_rms_norm(x, residual, weight, eps)

    def zero_centred_rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> torch.Tensor:
        if not norm.rows_supported(x):
            return super().zero_centred_rms_norm(x, weight, eps)
        return norm.rms_norm(x, weight, eps, zero_centred=True)

    def add_zero_centred_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: as add_rms_norm, the new residual is written into residual in place.
        if not norm.rows_supported(x):
            return super().add_zero_centred_rms_norm(x, residual, weight, eps)
        return norm.add_rms_norm(x, residual, weight, eps, zero_centred=True)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
        if not gated_norm_supported(x, gate):
            return super().gated_rms_norm(x, gate, weight, eps)
        return gated_rms_norm(x, gate, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)

    def fuses_dense_layer(self, hidden: torch.Tensor, weights: Sequence[object]) -> bool:
        # Where every projection would take the skinny kernel (decode rows,
        # bf16 matrices the size rule gives it): there the fused kernels
        # give the unfused kernels' bits with three launches fewer a layer.
        # Not in batch-invariant mode, whose prefill rows must match.
        if not self._fusing:
            return False
        rows = hidden.shape[0]
        return (skinny_fused.rows_fusable(hidden)
                and all(isinstance(w, torch.Tensor) and skinny_fused.weight_fusable(w, hidden)
                        and _skinny_wins(rows, w.numel()) for w in weights))

    @property
    def _fusing(self) -> bool:
        return self.fuse_layers and not self.deterministic

    def _fuses(self, x: torch.Tensor, weight: torch.Tensor, norm: bool) -> bool:
        """Whether one fused op takes (x, weight): the layer's rule, for this x."""
        return (self._fusing and skinny_fused.fusable(x, weight, norm=norm)
                and _skinny_wins(x.shape[0], weight.numel()))

    def norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._fuses(x, weight, norm=True):
            return skinny_fused.norm_skinny_linear(x, norm_weight, eps, weight, bias)
        return super().norm_linear(x, norm_weight, eps, weight, bias)

    def norm_swiglu(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    gate_up: torch.Tensor) -> torch.Tensor:
        if self._fuses(x, gate_up, norm=True):
            return skinny_fused.norm_skinny_swiglu(x, norm_weight, eps, gate_up)
        return super().norm_swiglu(x, norm_weight, eps, gate_up)

    def linear_add_(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        if self._fuses(x, weight, norm=False) and residual.is_contiguous():
            return skinny_fused.skinny_linear_add_(x, weight, bias, residual)
        return super().linear_add_(x, weight, bias, residual)

    def attention(
        self,
        config: ModelConfig,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rope_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if rope_cache is None:
            # q/k come rotated: the fused kernel still writes the cache, here
            # with the identity rotation (cos 1, sin 0 at position 0), exact.
            rope_cache = self.identity_rope
            positions = torch.zeros_like(positions)
        q = rope_and_cache(
            qkv, positions, rope_cache, k_cache, v_cache, meta.slot_mapping,
            config.num_heads, config.num_kv_heads, q_norm_weight, k_norm_weight,
            config.rms_norm_eps, k_scale=K_SCALE, v_scale=V_SCALE,
        )
        return self._paged_attention(config, q, kv_cache, meta)

    def _paged_attention(self, config: ModelConfig, q: torch.Tensor, kv_cache: KVCache,
                         meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], its K/V in the cache already -> [T, q_size]: the
        split-K decode kernel for decode rows, the prefill kernel otherwise.
        Either reads a bf16 or an fp8 cache (scaled by K_SCALE, V_SCALE)."""
        k_cache, v_cache = kv_cache
        scale = config.head_dim**-0.5
        if self.deterministic:
            return self._invariant_attention(config, q, kv_cache, meta)
        if meta.max_query_len == 1:
            out = paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                meta.max_seq_len, self.workspace, k_scale=K_SCALE, v_scale=V_SCALE,
            )
        else:
            out = paged_prefill_attention(
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                scale, meta.max_query_len, k_scale=K_SCALE, v_scale=V_SCALE,
            )
        return out.view(q.shape[0], config.q_size)

    def _invariant_attention(self, config: ModelConfig, q: torch.Tensor, kv_cache: KVCache,
                             meta: AttentionMetadata) -> torch.Tensor:
        """Every token a decode row (step_inputs.as_decode_rows), one split:
        a CTA per (row, kv head) walks the row's context in one fixed order,
        whatever the batch, the graph's context bucket or the phase."""
        if meta.max_query_len != 1:
            raise RuntimeError("batch-invariant ops need every token as its own attention row "
                               "(step_inputs.as_decode_rows)")
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
        # The grid's z dimension holds at most _MAX_GRID_ROWS rows a launch.
        for first in range(0, q.shape[0], _MAX_GRID_ROWS):
            rows = slice(first, first + _MAX_GRID_ROWS)
            paged_decode_attention(
                q[rows], k_cache, v_cache, meta.block_tables[rows], meta.seq_lens[rows],
                config.head_dim**-0.5, meta.max_seq_len, None, out[rows], k_scale=K_SCALE,
                v_scale=V_SCALE, num_splits=1,
            )
        return out.view(q.shape[0], config.q_size)

    def gated_attention(
        self,
        config: ModelConfig,
        projected: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rope_cache: torch.Tensor,
        q_norm_weight: torch.Tensor,
        k_norm_weight: torch.Tensor,
    ) -> torch.Tensor:
        # One launch for the q/k norms, partial RoPE and the cache write (read
        # from the interleaved projection in place), one for the gate; the
        # reference takes about twenty small ops and three copies.
        if (not rotary_dim_supported(config.head_dim, rope_cache.shape[-1])
                or not projected.is_contiguous() or projected.data_ptr() % 16):
            return super().gated_attention(config, projected, positions, meta, kv_cache,
                                           rope_cache, q_norm_weight, k_norm_weight)
        k_cache, v_cache = kv_cache
        q = gated_rope_and_cache(
            projected, positions, rope_cache, k_cache, v_cache, meta.slot_mapping,
            config.num_heads, config.num_kv_heads, q_norm_weight, k_norm_weight,
            config.rms_norm_eps, k_scale=K_SCALE, v_scale=V_SCALE,
        )
        out = self._paged_attention(config, q, kv_cache, meta)
        # The attention kernels allocated out: gated in place.
        return sigmoid_gate_mul(out, projected, config.num_heads, out=out)

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not gated_delta.conv_supported(weight.shape[1]):
            return super().causal_conv1d(x, weight, bias, conv_states, meta)
        assert meta.state_slots is not None and meta.state_fresh is not None
        return gated_delta.causal_conv1d(x, weight, bias, conv_states, meta.state_slots,
                                         meta.state_fresh, meta.query_start_loc)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                         dt_bias: torch.Tensor, states: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        # Head sizes the kernel is not built for (tiny test models) take the
        # reference, which reads the batch on the host: eager steps only.
        if not gated_delta.rule_supported(q.shape[-1], v.shape[-1]):
            return super().gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states, meta)
        assert meta.state_slots is not None and meta.state_fresh is not None
        if meta.max_query_len > 1 and gated_delta_tc.tc_supported(q.shape[-1], v.shape[-1]):
            return self._gated_delta_rule_prompts(q, k, v, a, b, a_log, dt_bias, states, meta)
        # NOTE: sequences of at least MIN_CHUNKED_TOKENS tokens in an eager
        # step run the chunked form (matrix products, a host loop per chunk);
        # the recurrent kernel (a latency-bound step per token) serves the
        # rest, and everything inside CUDA graphs, whose steps pass no host
        # bounds (query_start_loc_host == ()).
        long = gated_delta_chunked.chunked_sequences(meta.query_start_loc_host)
        if not long:
            return gated_delta.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states,
                                                meta.state_slots, meta.state_fresh,
                                                meta.query_start_loc)
        out = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
        if len(long) < len(meta.query_start_loc_host) - 1:
            # The kernel skips a sequence whose slot is < 0: hide the long ones.
            qsl = meta.query_start_loc
            lengths = qsl[1:] - qsl[:-1]
            short_slots = torch.where(lengths >= gated_delta_chunked.MIN_CHUNKED_TOKENS,
                                      -1, meta.state_slots)
            gated_delta.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states, short_slots,
                                         meta.state_fresh, qsl, out=out)
        return gated_delta_chunked.gated_delta_rule_chunked(
            q, k, v, a, b, a_log, dt_bias, states, meta.state_slots, meta.state_fresh,
            meta.query_start_loc_host, sequences=long, out=out)

    def _gated_delta_rule_prompts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                                  dt_bias: torch.Tensor, states: torch.Tensor,
                                  meta: AttentionMetadata) -> torch.Tensor:
        # NOTE: a step with prompt chunks (max_query_len > 1, an upper bound
        # that graph steps set too; decode and verify steps lay out single
        # rows) runs sequences of MIN_TC_TOKENS or more through the chunked
        # tensor-core kernel and the rest through the recurrent one. Each
        # kernel skips the other's sequences on the device, so nothing is
        # read back and graphs on and off compute the same numbers.
        assert meta.state_slots is not None and meta.state_fresh is not None
        qsl = meta.query_start_loc
        least = gated_delta_tc.MIN_TC_TOKENS
        out = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
        short_slots = torch.where(qsl[1:] - qsl[:-1] >= least, -1, meta.state_slots)
        gated_delta.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states, short_slots,
                                     meta.state_fresh, qsl, out=out)
        return gated_delta_tc.gated_delta_rule_tc(q, k, v, a, b, a_log, dt_bias, states,
                                                  meta.state_slots, meta.state_fresh, qsl,
                                                  out=out, min_tokens=least)

    def moe_route(self, router_logits: torch.Tensor, top_k: int,
                  normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return moe.moe_route(router_logits, top_k, normalize)  # ids int32

    def moe_experts(self, hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor,
                    cache: moe.ExpertCacheView | None = None) -> torch.Tensor:
        # NOTE: decode-sized steps run the expert GEMV, which reads only the
        # selected experts (each pair its own: tokens sharing an expert meet
        # in L2); larger ones group tokens by expert and read each selected
        # expert once through the grouped GEMM (kernels/moe_grouped.py). Both
        # read nothing back to the host, so CUDA graphs capture either.
        weights = weights.float()
        num_experts = gate_up.shape[0]
        # Over the bus (host-resident stacks) a pair's expert read costs the
        # same whether it is cached in L2 or not: past half the stack's bytes
        # in pair reads, copying the whole stack once is cheaper.
        most = 2 * num_experts if gate_up.is_cuda else num_experts // 2
        if experts.numel() <= min(MOE_GEMV_MAX_PAIRS, most):
            workspace = self._moe_workspace(gate_up.shape[1] // 2, hidden.device)
            return moe.moe_experts_gemv(hidden, gate_up, down, experts.int(), weights,
                                        workspace=workspace, cache=cache)
        if not gate_up.is_cuda:
            # Host-resident experts: the layer's stacks cross the bus once for
            # all of the step's tokens, into a device buffer shared by every
            # layer (they run one after another on one stream).
            gate_up, down = self._staged_experts(gate_up, down, hidden.device)
        return moe_grouped.moe_experts_grouped(hidden, gate_up, down, experts.long(), weights,
                                               silu_and_mul=activation.silu_and_mul)

    def shared_expert_combine(self, routed: torch.Tensor, shared: torch.Tensor,
                              gate_logit: torch.Tensor) -> torch.Tensor:
        if not combine_supported(routed, shared, gate_logit):
            return super().shared_expert_combine(routed, shared, gate_logit)
        # Written over shared: this forward pass's own intermediate.
        return shared_expert_combine(routed, shared, gate_logit, out=shared)

    def _moe_workspace(self, intermediate: int, device: torch.device) -> torch.Tensor:
        if self.moe_workspace is None or self.moe_workspace.shape[1] != intermediate:
            self.moe_workspace = moe.moe_gemv_workspace(MOE_GEMV_MAX_PAIRS, intermediate, device)
        return self.moe_workspace

    def _staged_experts(self, gate_up: torch.Tensor, down: torch.Tensor,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        staged = self.staged_experts
        if staged is None or staged[0].shape != gate_up.shape:
            staged = (torch.empty_like(gate_up, device=device),
                      torch.empty_like(down, device=device))
            self.staged_experts = staged
        staged[0].copy_(gate_up, non_blocking=True)
        staged[1].copy_(down, non_blocking=True)
        return staged


# Token-expert pairs up to which the expert GEMV runs, and at most two per
# expert on average (each pair reads its own expert): above, the grouped GEMM
# reads each selected expert once. Measured on the H200 at Qwen3-30B-A3B's
# experts (bench_gpu_moe.py): the GEMV takes 25 / 134 / 399 us at 1 / 8 / 32
# tokens (73-89% of the copy rate up to 16), the grouped path 92 / 251 / 458;
# at 64 tokens the grouped path wins (499 vs 703).
MOE_GEMV_MAX_PAIRS = 256


def _skinny_wins(rows: int, weight_elements: int) -> bool:
    """Where the skinny kernel beat cuBLAS on the H200 (bench_skinny_gemm.py,
    docs/performance.md): matrices up to 16M elements (Qwen3-0.6B's, Qwen3-8B's
    attention projections) at 1..8 rows, up to 32M at one or two rows. On
    larger ones cuBLAS streams at 80-95% of the copy rate and wins."""
    return weight_elements <= 16 << 20 or (rows <= 2 and weight_elements <= 32 << 20)


# The most elements the packed matrices' dequantization scratch holds (bf16,
# 128 MiB): the largest dense projection of an 8B model (gate_up, 100M
# elements) goes in two chunks, a large vocabulary's lm_head in several.
QUANT_SCRATCH_MAX_ELEMENTS = 64 << 20
# An FP8 segment is cut for the scratch at multiples of its scale blocks' rows.
FP8_CHUNK_ROWS = 128
# The decode kernel's grid holds this many rows (its z dimension) a launch.
_MAX_GRID_ROWS = 65535

REFERENCE_OPS = ReferenceOps()


def make_ops(config: ModelConfig, device: torch.device, *, use_kernels: bool, max_batch: int,
             max_context: int, model: nn.Module | None = None,
             deterministic: bool = False) -> ReferenceOps:
    """The ops a model runs: our kernels (their decode workspace sized for
    max_batch rows and max_context tokens, their dequantization scratch for
    model's largest packed matrix) or the torch reference; deterministic:
    their batch-invariant forms (--deterministic)."""
    if not use_kernels:
        if deterministic:
            # Imported here: rowwise_ops builds on this module's ReferenceOps.
            from engine.execution.rowwise_ops import ROWWISE_OPS
            return ROWWISE_OPS
        return REFERENCE_OPS
    scratch = largest_quantized_elements(model) if model is not None else 0
    return CudaOps(config, device, max_batch, max_context, quant_scratch_elements=scratch,
                   deterministic=deterministic)


# Head sizes the attention and RoPE kernels are built for (256: Qwen3-Next's
# and Qwen3.5's full-attention layers).
KERNEL_HEAD_DIMS = (64, 128, 256)


def kernels_usable(device: torch.device, dtype: torch.dtype, config: ModelConfig) -> bool:
    """Our kernels run bf16 on CUDA for the head sizes they are built for;
    anything else takes the reference ops."""
    if device.type != "cuda" or dtype != torch.bfloat16 or config.head_dim not in KERNEL_HEAD_DIMS:
        return False
    return cuda_available()
