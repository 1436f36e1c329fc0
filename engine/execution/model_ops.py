"""The ops a decoder layer calls, in two implementations with one interface.

ReferenceOps runs kernels.reference (pure torch): the CPU path, any dtype, and
CUDA in float32/float16. CudaOps runs our CUDA kernels (bf16 on a GPU): RMSNorm
with the residual add fused in, RoPE fused with Qwen3's q/k norms and the KV
cache write, SwiGLU, and paged attention (a split-K decode kernel for decode
steps, a tensor-core prefill kernel for steps with prompt chunks). GEMMs are
torch's (cuBLAS), except the projections of steps with at most 8 rows, which
a bandwidth-bound skinny GEMM kernel does (kernels/skinny_gemm.py).

A decode step on CudaOps reads nothing on the host and allocates only torch
intermediates, so it can be captured into a CUDA graph (engine/execution/cuda_graphs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.execution.attention_metadata import AttentionMetadata
from kernels import activation, moe_reference, norm, reference
from kernels.cuda_build import cuda_available
from kernels.decode_attention import decode_workspace, paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.rope_cache import rope_and_cache
from kernels.skinny_gemm import skinny_linear, skinny_linear_supported

if TYPE_CHECKING:
    from engine.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class ReferenceOps:
    name = "reference"

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x)

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
        """qkv: [T, q_size + 2 * kv_size] -> attention output [T, q_size]."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
        q = q.view(tokens, config.num_heads, config.head_dim)
        k = k.view(tokens, config.num_kv_heads, config.head_dim)
        v = v.view(tokens, config.num_kv_heads, config.head_dim)
        if q_norm_weight is not None and k_norm_weight is not None:
            q = reference.rms_norm(q, q_norm_weight, config.rms_norm_eps)
            k = reference.rms_norm(k, k_norm_weight, config.rms_norm_eps)
        q, k = reference.apply_rope(positions, q, k, rope_cache)
        k_cache, v_cache = kv_cache
        reference.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = reference.paged_attention(
            q, k_cache, v_cache, meta.query_start_loc_host, meta.seq_lens_host,
            meta.block_tables, config.head_dim**-0.5,
        )
        return out.view(tokens, config.q_size)

    def moe_experts(self, hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Stacked SwiGLU experts: hidden [T, H], gate_up [E, 2I, H], down [E, H, I],
        experts/weights [T, k] -> the weighted sum of each token's experts [T, H]."""
        return moe_reference.moe_experts(hidden, gate_up, down, experts, weights)


class CudaOps(ReferenceOps):
    """Our kernels. decode_batch and max_seq_len size the split-K workspace of
    the decode kernel: the most rows a decode step has, and the longest
    sequence it can see (the served context)."""

    name = "cuda"

    def __init__(self, config: ModelConfig, device: torch.device, decode_batch: int,
                 max_seq_len: int) -> None:
        self.device = device
        self.decode_batch = decode_batch
        self.max_seq_len = max_seq_len
        self.workspace = decode_workspace(decode_batch, config.num_heads, config.head_dim,
                                          max_seq_len, device)

    def workspace_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self.workspace).values()
                   if isinstance(t, torch.Tensor))

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: for a few rows (decode) cuBLAS streams the smaller matrices at
        # 8-50% of the copy rate (bench_skinny_gemm.py); our kernel beats it
        # there. Larger batches and larger matrices stay with cuBLAS.
        if skinny_linear_supported(x, weight) and _skinny_wins(x.shape[0], weight.numel()):
            return skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: the kernel writes x + residual into residual in place; the
        # residual stream is this forward pass's own tensor, never a weight.
        return norm.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)

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
        q = rope_and_cache(
            qkv, positions, rope_cache, k_cache, v_cache, meta.slot_mapping,
            config.num_heads, config.num_kv_heads, q_norm_weight, k_norm_weight,
            config.rms_norm_eps,
        )
        scale = config.head_dim**-0.5
        if meta.max_query_len == 1:
            out = paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                meta.max_seq_len, self.workspace,
            )
        else:
            out = paged_prefill_attention(
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                scale, meta.max_query_len,
            )
        return out.view(qkv.shape[0], config.q_size)

    def moe_experts(self, hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # NOTE: no expert kernels yet (issue 17). The torch loop reads the routing
        # back to the host, which a CUDA graph capture forbids; while capturing,
        # every expert runs over every row instead (zero-weighted where unpicked).
        if torch.cuda.is_current_stream_capturing():
            return moe_reference.moe_experts_dense(hidden, gate_up, down, experts, weights)
        return moe_reference.moe_experts(hidden, gate_up, down, experts, weights)


def _skinny_wins(rows: int, weight_elements: int) -> bool:
    """Where the skinny kernel beat cuBLAS on the H200 (bench_skinny_gemm.py,
    docs/performance.md): matrices up to 16M elements (Qwen3-0.6B's, Qwen3-8B's
    attention projections) at 1..8 rows, up to 32M at one or two rows. On
    larger ones cuBLAS streams at 80-95% of the copy rate and wins."""
    return weight_elements <= 16 << 20 or (rows <= 2 and weight_elements <= 32 << 20)


REFERENCE_OPS = ReferenceOps()


def make_ops(config: ModelConfig, device: torch.device, *, use_kernels: bool, max_batch: int,
             max_context: int) -> ReferenceOps:
    """The ops a model runs: our kernels (their decode workspace sized for
    max_batch rows and max_context tokens) or the torch reference."""
    if not use_kernels:
        return REFERENCE_OPS
    return CudaOps(config, device, max_batch, max_context)


# Head sizes the attention and RoPE kernels are built for.
KERNEL_HEAD_DIMS = (64, 128)


def kernels_usable(device: torch.device, dtype: torch.dtype, config: ModelConfig) -> bool:
    """Our kernels run bf16 on CUDA for the head sizes they are built for;
    anything else takes the reference ops."""
    if device.type != "cuda" or dtype != torch.bfloat16 or config.head_dim not in KERNEL_HEAD_DIMS:
        return False
    return cuda_available()
