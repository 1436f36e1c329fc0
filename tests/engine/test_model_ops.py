"""Which ops a model runs: the reference ops wherever our CUDA kernels cannot."""

from __future__ import annotations

import pytest
import torch

from engine.execution import model_ops
from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.model_ops import REFERENCE_OPS, _skinny_wins, kernels_usable
from engine.models import ModelConfig
from tests.perf.gpu_models import hf_config


def config(**changes: object) -> ModelConfig:
    return ModelConfig.from_hf_config({**hf_config("qwen3-0.6b"), **changes})


def test_the_cpu_and_other_dtypes_and_head_sizes_take_the_reference_ops() -> None:
    assert not kernels_usable(torch.device("cpu"), torch.bfloat16, config())
    # Whatever the machine: float32 and head size 96 never reach the kernels.
    assert not kernels_usable(torch.device("cuda", 0), torch.float32, config())
    assert not kernels_usable(torch.device("cuda", 0), torch.bfloat16, config(head_dim=96))


def test_every_built_head_size_reaches_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a GPU with CuPy: bf16 at 64, 128 and 256 (Qwen3-Next's and
    # Qwen3.5's full attention) takes our kernels, other head sizes do not.
    monkeypatch.setattr(model_ops, "cuda_available", lambda: True)
    cuda = torch.device("cuda", 0)
    for head_dim in (64, 128, 256):
        assert kernels_usable(cuda, torch.bfloat16, config(head_dim=head_dim)), head_dim
    assert not kernels_usable(cuda, torch.bfloat16, config(head_dim=96))
    assert not kernels_usable(cuda, torch.float16, config(head_dim=256))


def test_the_skinny_gemm_takes_only_the_matrices_it_measured_faster_on() -> None:
    assert _skinny_wins(1, 6144 * 1024) and _skinny_wins(8, 4096 * 4096)
    assert _skinny_wins(1, 6144 * 4096) and not _skinny_wins(4, 6144 * 4096)
    assert not _skinny_wins(1, 24576 * 4096)


def test_reference_linear_is_torch_linear() -> None:
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(REFERENCE_OPS.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def _meta(lengths: list[int], slots: list[int], fresh: list[bool]) -> AttentionMetadata:
    """A batch of sequences with no paged KV (linear-attention ops only read
    query_start_loc_host, state_slots and state_fresh on the reference path)."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=empty,
        block_tables=empty, slot_mapping=empty.long(), max_query_len=max(lengths),
        max_seq_len=0, query_start_loc_host=tuple(starts), seq_lens_host=(),
        state_slots=torch.tensor(slots), state_fresh=torch.tensor(fresh))


def test_reference_linear_attention_ops_run_the_reference_over_the_batch_state_slots() -> None:
    from kernels import gated_delta_reference as ref

    gen = torch.Generator().manual_seed(0)
    meta = _meta([3, 0, 1], [2, 0, 1], [True, False, False])
    x, weight = torch.randn(4, 12, generator=gen), torch.randn(12, 4, generator=gen)
    conv_states = torch.randn(3, 12, 3, generator=gen)
    expected_conv_states = conv_states.clone()
    expected = ref.causal_conv1d(x, weight, None, expected_conv_states, meta.state_slots,
                                 meta.state_fresh, meta.query_start_loc_host)
    got = REFERENCE_OPS.causal_conv1d(x, weight, None, conv_states, meta)
    assert torch.equal(got, expected) and torch.equal(conv_states, expected_conv_states)

    q, k = torch.randn(4, 1, 8, generator=gen), torch.randn(4, 1, 8, generator=gen)
    v, a, b = (torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, generator=gen),
               torch.randn(4, 2, generator=gen))
    a_log, dt_bias = torch.randn(2, generator=gen), torch.randn(2, generator=gen)
    states = torch.randn(3, 2, 8, 8, generator=gen)
    expected_states = states.clone()
    g, beta = ref.gdn_gating(a, b, a_log, dt_bias)
    expected = ref.gated_delta_rule(q, k, v, g, beta, expected_states, meta.state_slots,
                                    meta.state_fresh, meta.query_start_loc_host)
    got = REFERENCE_OPS.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states, meta)
    assert torch.equal(got, expected) and torch.equal(states, expected_states)


def test_reference_attention_without_rope_cache_takes_q_and_k_as_rotated() -> None:
    """GatedAttention rotates q/k itself (partial RoPE) and passes no rope
    cache: the op must then attend exactly as over q/k rotated by it."""
    from kernels.reference import apply_rope, build_rope_cache

    cfg = config(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(3)
    tokens, page = 5, 8
    qkv = torch.randn(tokens, cfg.qkv_size, generator=gen)
    positions = torch.arange(tokens)
    rope = build_rope_cache(16, 32, 10000.0, None, "cpu", torch.float32)
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q_rot, k_rot = apply_rope(positions, q.view(tokens, 4, 16), k.view(tokens, 2, 16), rope)
    rotated = torch.cat([q_rot.reshape(tokens, -1), k_rot.reshape(tokens, -1), v], dim=-1)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.arange(page, page + tokens), max_query_len=tokens,
        max_seq_len=tokens, query_start_loc_host=(0, tokens), seq_lens_host=(tokens,))
    results = []
    for inputs, table in ((qkv, rope), (rotated, None)):
        caches = (torch.zeros(cfg.kv_cache_shape(2, page)), torch.zeros(cfg.kv_cache_shape(2, page)))
        results.append(REFERENCE_OPS.attention(cfg, inputs, positions, meta, caches, table,
                                               None, None))
    assert torch.equal(results[0], results[1])
