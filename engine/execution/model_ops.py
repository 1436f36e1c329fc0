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
from kernels import activation, moe, moe_grouped, moe_reference, norm, reference
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
        # The expert GEMV's activations, allocated before any graph is captured.
        self.moe_workspace = (moe.moe_gemv_workspace(MOE_GEMV_MAX_PAIRS,
                                                     config.moe.intermediate_size, device)
                              if config.moe is not None else None)
        # Host-resident experts' stacks, one layer's at a time, for large steps.
        self.staged_experts: tuple[torch.Tensor, torch.Tensor] | None = None

    def workspace_bytes(self) -> int:
        tensors = [t for t in vars(self.workspace).values() if isinstance(t, torch.Tensor)]
        if self.moe_workspace is not None:
            tensors.append(self.moe_workspace)
        tensors += self.staged_experts or ()
        return sum(t.numel() * t.element_size() for t in tensors)

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
