"""The hybrid models' ops (zero-centred norms, gated norm, gated attention,
shared-expert combine): the reference ops compute exactly what the layers
computed before they became ops, and CudaOps sends to our kernels exactly
the calls those take, the rest to the reference. (The kernels themselves:
tests/kernels/test_hybrid_norms_gpu.py, test_gated_rope_cache_gpu.py,
test_shared_expert_gpu.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.execution import model_ops
from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.model_ops import REFERENCE_OPS, CudaOps
from engine.models import ModelConfig
from kernels import reference
from kernels.gated_rope_cache import rotary_dim_supported
from tests.perf.gpu_models import hf_config

EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen(seed)) * scale).to(torch.bfloat16)


def test_zero_centred_norms_are_the_float32_formula_rounded_once() -> None:
    x, residual, w = bf16(5, 64, seed=1, scale=3), bf16(5, 64, seed=2), bf16(64, seed=3, scale=0.1)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
                * (1.0 + w.float())).to(torch.bfloat16)
    assert torch.equal(REFERENCE_OPS.zero_centred_rms_norm(x, w, EPS), expected)
    out, summed = REFERENCE_OPS.add_zero_centred_rms_norm(x, residual, w, EPS)
    # transformers' layer: the residual add in bf16, then the norm.
    assert torch.equal(summed, residual + x)
    assert torch.equal(out, REFERENCE_OPS.zero_centred_rms_norm(residual + x, w, EPS))


def test_gated_rms_norm_is_the_gated_delta_net_formula() -> None:
    x, z, w = bf16(3, 4, 16, seed=4, scale=2), bf16(3, 4, 16, seed=5), bf16(16, seed=6)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    expected = (w * normed * F.silu(z.float())).to(torch.bfloat16)
    assert torch.equal(REFERENCE_OPS.gated_rms_norm(x, z, w, EPS), expected)


def test_shared_expert_combine_is_routed_plus_gated_shared() -> None:
    routed, shared, logit = bf16(3, 32, seed=7), bf16(3, 32, seed=8), bf16(3, 1, seed=9)
    assert torch.equal(REFERENCE_OPS.shared_expert_combine(routed, shared, logit),
                       routed + torch.sigmoid(logit) * shared)


def _config(**changes: object) -> ModelConfig:
    return ModelConfig.from_hf_config({**hf_config("qwen3-0.6b"), **changes})


def _single_sequence_meta(tokens: int, page_size: int) -> AttentionMetadata:
    pages = -(-tokens // page_size)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.arange(pages, dtype=torch.int32).view(1, pages),
        slot_mapping=torch.arange(tokens), max_query_len=tokens, max_seq_len=tokens,
        query_start_loc_host=(0, tokens), seq_lens_host=(tokens,))


def test_reference_gated_attention_is_the_layer_before_it_became_an_op() -> None:
    """Norms, partial RoPE over the interleaved q|gate projection, cached k/v,
    attention and the sigmoid gate, written out as GatedAttention did."""
    config = _config(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    tokens, page = 6, 4
    projected = bf16(tokens, 2 * config.q_size + 2 * config.kv_size, seed=10, scale=2)
    positions = torch.arange(tokens)
    rope = reference.build_rope_cache(8, 64, 1e4, None, "cpu", torch.bfloat16)  # 8 of 32
    q_w, k_w = bf16(32, seed=11, scale=0.1), bf16(32, seed=12, scale=0.1)
    meta = _single_sequence_meta(tokens, page)
    shape = config.kv_cache_shape(2, page)
    caches = (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
    got = REFERENCE_OPS.gated_attention(config, projected, positions, meta, caches, rope,
                                        q_w, k_w)

    def zc(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
                * (1.0 + w.float())).to(x.dtype)

    q_and_gate, k, v = projected.split([2 * config.q_size, config.kv_size, config.kv_size], -1)
    q, gate = q_and_gate.view(tokens, 4, 64).chunk(2, dim=-1)
    q, k = zc(q, q_w), zc(k.reshape(tokens, 2, 32), k_w)
    q_rot, k_rot = reference.apply_rope(positions, q[..., :8], k[..., :8], rope)
    q, k = torch.cat((q_rot, q[..., 8:]), -1), torch.cat((k_rot, k[..., 8:]), -1)
    k_cache, v_cache = (torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2))
    reference.write_kv_cache(k, v.reshape(tokens, 2, 32), k_cache, v_cache, meta.slot_mapping)
    out = reference.paged_attention(q, k_cache, v_cache, (0, tokens), (tokens,),
                                    meta.block_tables, 32**-0.5)
    expected = out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
    assert torch.equal(got, expected)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


def test_the_fused_rope_kernel_takes_whole_heads_or_a_power_of_two_part() -> None:
    assert rotary_dim_supported(256, 64)  # Qwen3.5 / Qwen3-Next
    assert rotary_dim_supported(128, 32)  # the tiny GPU test models (factor 0.25)
    assert rotary_dim_supported(256, 256) and rotary_dim_supported(256, 128)
    assert rotary_dim_supported(64, 16)
    for head_dim, rotary in ((256, 96), (256, 192), (256, 8), (96, 32), (128, 24)):
        assert not rotary_dim_supported(head_dim, rotary), (head_dim, rotary)


class _Calls:
    """Records the kernel entry points CudaOps reaches (in place of the kernels)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def recorder(self, name: str, result: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return result(*args) if callable(result) else result
        return record


def _bare_cuda_ops() -> CudaOps:
    # The dispatch only, without a GPU: no workspaces.
    return object.__new__(CudaOps)


def test_cuda_ops_send_supported_norms_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _Calls()
    marker = torch.zeros(1)
    monkeypatch.setattr(model_ops.norm, "rows_supported", lambda x: True)
    monkeypatch.setattr(model_ops.norm, "rms_norm", calls.recorder("rms_norm", marker))
    monkeypatch.setattr(model_ops.norm, "add_rms_norm",
                        calls.recorder("add_rms_norm", (marker, marker)))
    monkeypatch.setattr(model_ops, "gated_norm_supported", lambda x, g: True)
    monkeypatch.setattr(model_ops, "gated_rms_norm", calls.recorder("gated_rms_norm", marker))
    monkeypatch.setattr(model_ops, "combine_supported", lambda r, s, g: True)
    monkeypatch.setattr(model_ops, "shared_expert_combine", calls.recorder("combine", marker))
    ops = _bare_cuda_ops()
    x, r, w = bf16(2, 16, seed=1), bf16(2, 16, seed=2), bf16(16, seed=3)
    assert ops.zero_centred_rms_norm(x, w, EPS) is marker
    assert ops.add_zero_centred_rms_norm(x, r, w, EPS) == (marker, marker)
    assert ops.gated_rms_norm(x.view(2, 2, 8), r.view(2, 2, 8), w[:8], EPS) is marker
    assert ops.shared_expert_combine(x, r, w[:2].view(2, 1)) is marker
    names = [(name, kwargs) for name, _, kwargs in calls.calls]
    assert names == [("rms_norm", {"zero_centred": True}),
                     ("add_rms_norm", {"zero_centred": True}),
                     ("gated_rms_norm", {}), ("combine", {"out": r})]


def test_cuda_ops_take_the_reference_where_the_kernels_cannot() -> None:
    # CPU tensors: no kernel takes them, every op gives the reference's bits.
    ops = _bare_cuda_ops()
    x, r, w = bf16(2, 16, seed=1), bf16(2, 16, seed=2), bf16(16, seed=3, scale=0.1)
    assert torch.equal(ops.zero_centred_rms_norm(x, w, EPS),
                       REFERENCE_OPS.zero_centred_rms_norm(x, w, EPS))
    got = ops.add_zero_centred_rms_norm(x, r.clone(), w, EPS)
    expected = REFERENCE_OPS.add_zero_centred_rms_norm(x, r.clone(), w, EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    z = bf16(2, 2, 8, seed=4)
    assert torch.equal(ops.gated_rms_norm(x.view(2, 2, 8), z, w[:8], EPS),
                       REFERENCE_OPS.gated_rms_norm(x.view(2, 2, 8), z, w[:8], EPS))
    assert torch.equal(ops.shared_expert_combine(x, r, w[:2].view(2, 1)),
                       REFERENCE_OPS.shared_expert_combine(x, r, w[:2].view(2, 1)))


def test_cuda_ops_gated_attention_fuses_supported_rotary_dims(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A supported partial rotary: one fused kernel, the attention kernel, the
    gate kernel on the attention output in place; otherwise the reference
    composition (which reaches the shared attention op)."""
    config = _config(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    calls = _Calls()
    tokens = 3
    q = torch.zeros(tokens, 4, 64, dtype=torch.bfloat16)
    attended = torch.ones(tokens, 4, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(model_ops, "gated_rope_and_cache", calls.recorder("rope", q))
    monkeypatch.setattr(model_ops, "paged_prefill_attention", calls.recorder("prefill", attended))
    monkeypatch.setattr(model_ops, "sigmoid_gate_mul",
                        calls.recorder("gate", lambda out, *rest: out))
    ops = _bare_cuda_ops()
    projected = bf16(tokens, 2 * config.q_size + 2 * config.kv_size, seed=5)
    meta = _single_sequence_meta(tokens, 4)
    caches = (torch.zeros(1), torch.zeros(1))
    weights = (bf16(64, seed=6), bf16(64, seed=7))
    positions = torch.arange(tokens)
    out = ops.gated_attention(config, projected, positions, meta, caches,
                              torch.zeros(16, 16, dtype=torch.bfloat16), *weights)
    assert [name for name, _, _ in calls.calls] == ["rope", "prefill", "gate"]
    rope_args = calls.calls[0][1]
    assert rope_args[0] is projected and rope_args[8] is weights[0] and rope_args[9] is weights[1]
    gate_args, gate_kwargs = calls.calls[2][1], calls.calls[2][2]
    assert gate_args[1] is projected and gate_kwargs["out"].data_ptr() == attended.data_ptr()
    assert out.shape == (tokens, config.q_size)

    # Rotary 24 of 64: not the kernel's; the reference composition instead.
    calls.calls.clear()
    composed: list[torch.Tensor] = []
    monkeypatch.setattr(CudaOps, "attention",
                        lambda self, cfg, qkv, *rest: composed.append(qkv) or qkv[:, :256])
    ops.gated_attention(config, projected, positions, meta, caches,
                        torch.zeros(16, 24, dtype=torch.bfloat16), *weights)
    assert not calls.calls and len(composed) == 1
    assert composed[0].shape == (tokens, config.q_size + 2 * config.kv_size)
