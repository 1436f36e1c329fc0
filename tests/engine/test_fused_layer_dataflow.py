"""The dense decoder layer's fused dataflow against its unfused path, on the CPU.

Where the ops fuse a dense layer (CudaOps, decode rows), DecoderLayer runs
with the residual stream summed (engine/models/decoder.py _fused_forward).
ReferenceOps implements the fused ops as their unfused chains, so a
ReferenceOps that claims to fuse runs the same operations in the fused
order: every hidden state, logit and cached K/V must then have the same bits
as plain ReferenceOps, in float32 and in bfloat16 (float additions commute,
the projection is rounded before its add either way, nothing else changes).
Fusing only some layers exercises the hand-overs both ways (an unfused
layer's (out, residual) into a fused one, a fused layer's (stream, None) into
an unfused one or the final norm). The models are tiny and random: norms away
from 1 and biases away from 0, so a weight dropped from the chain shows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

import pytest
import torch

from engine.execution.model_ops import ReferenceOps
from engine.models import CausalLM, ModelConfig, build_model
from engine.models.decoder import MLP
from tests.engine.test_model_exactness import PagedRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
NUM_LAYERS = 4
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
)
CONFIGS: dict[str, dict[str, Any]] = {
    # q/k norms; 4 x 32 query width unlike the hidden 64, tied lm_head.
    "qwen3": {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32,
              "tie_word_embeddings": True},
    # q/k/v biases, none on o_proj.
    "qwen2": {**_COMMON, "architectures": ["Qwen2ForCausalLM"]},
    "llama": {**_COMMON, "architectures": ["LlamaForCausalLM"]},
    # Biases on q/k/v and o_proj: linear_add_ adds o_proj's bias too.
    "llama_bias": {**_COMMON, "architectures": ["LlamaForCausalLM"], "attention_bias": True},
    # Layers 1 and 3 sparse (decoder_sparse_step 2), 0 and 2 dense.
    "qwen3_moe": {**_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 2, "norm_topk_prob": True},
}
# Which layers the fusing ops fuse: all, then mixes whose first and last
# layers are fused or not, with hand-overs in both directions between.
LAYER_SETS: dict[str, frozenset[int]] = {
    "all": frozenset(range(NUM_LAYERS)),
    "even": frozenset({0, 2}),
    "odd": frozenset({1, 3}),
    "ends": frozenset({0, NUM_LAYERS - 1}),
    "middle": frozenset({1, 2}),
}
# Three sequences' prompts (two prefill steps, the second over cached pages
# for sequence 0), then two decode steps of all three.
PROMPTS = ([5, 17, 200, 3, 99, 42, 7, 150, 31, 64, 2, 250, 18, 77, 120, 9, 33, 180],
           [11, 240, 56, 3], [1, 2, 3, 4, 5, 6, 7])
DECODE_TOKENS = ([[90], [14], [201]], [[66], [8], [130]])


def _fusable(name: str) -> frozenset[int]:
    """The layers of CONFIGS[name] with a dense MLP, the only ones that fuse."""
    moe = ModelConfig.from_hf_config(CONFIGS[name]).moe
    return frozenset(i for i in range(NUM_LAYERS) if moe is None or not moe.is_sparse(i))


# (model, layer set) pairs where some layer fuses: the sparse layers alone
# would test nothing here (test_a_sparse_layer_is_never_offered_the_fused_form).
CASES = [(name, layers) for name in CONFIGS for layers in LAYER_SETS
         if LAYER_SETS[layers] & _fusable(name)]


class FusingOps(ReferenceOps):
    """ReferenceOps that takes the fused dataflow in the given layers of
    model, whatever the rows, and records the layers that ran it."""

    def __init__(self, model: CausalLM, layers: Collection[int]) -> None:
        self.layers = frozenset(layers)
        # Each layer's qkv weight names it: the first weight either call gets.
        self.layer_of = {id(layer.self_attn.qkv_weight): index
                         for index, layer in enumerate(model.layers)}
        self.fused: list[int] = []  # layers whose norm_linear ran, in order
        self.calls: Counter[str] = Counter()

    def fuses_dense_layer(self, hidden: torch.Tensor, weights: Sequence[object]) -> bool:
        return self.layer_of[id(weights[0])] in self.layers

    def norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.fused.append(self.layer_of[id(weight)])
        self.calls["norm_linear"] += 1
        return super().norm_linear(x, norm_weight, eps, weight, bias)

    def norm_swiglu(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    gate_up: torch.Tensor) -> torch.Tensor:
        self.calls["norm_swiglu"] += 1
        return super().norm_swiglu(x, norm_weight, eps, gate_up)

    def linear_add_(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        self.calls["linear_add_"] += 1
        return super().linear_add_(x, weight, bias, residual)


def _random_model(name: str, dtype: torch.dtype) -> CausalLM:
    model = build_model(ModelConfig.from_hf_config(CONFIGS[name]), "cpu", dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # Norm weights near 1 (never exactly), every other tensor small.
            param.copy_(1 + 0.2 * noise if "norm" in param_name else 0.1 * noise)
    return model


def _run(model: CausalLM, ops: ReferenceOps) -> tuple[list[torch.Tensor], PagedRunner]:
    """Each step's final hidden states and logits, in order; and the runner
    (its KV caches)."""
    model.ops = ops
    runner = PagedRunner(model, num_pages=12, seed=3)
    a, b, c = PROMPTS
    steps = [[(0, a[:9]), (1, b)], [(0, a[9:]), (2, c)]]
    steps += [[(seq, tokens) for seq, tokens in enumerate(step)] for step in DECODE_TOKENS]
    out: list[torch.Tensor] = []
    for work in steps:
        hidden = runner.step(work)
        with torch.inference_mode():
            out += [hidden, model.compute_logits(hidden)]
    return out, runner


def _dense_layers(model: CausalLM) -> frozenset[int]:
    return frozenset(i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MLP))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "layer_set"), CASES)
def test_fused_dataflow_gives_the_unfused_bits(name: str, layer_set: str,
                                               dtype: torch.dtype) -> None:
    model = _random_model(name, dtype)
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    expected, reference_runner = _run(model, ReferenceOps())
    fusing = FusingOps(model, LAYER_SETS[layer_set])
    got, fused_runner = _run(model, fusing)

    # Taken where asked, in every step, and never in a sparse (MoE) layer.
    fused_layers = sorted(LAYER_SETS[layer_set] & _dense_layers(model))
    steps = len(expected) // 2
    assert fusing.fused == fused_layers * steps
    assert fusing.calls == {"norm_linear": len(fusing.fused), "norm_swiglu": len(fusing.fused),
                            "linear_add_": 2 * len(fusing.fused)}

    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        what = "logits" if index % 2 else "hidden states"
        assert torch.equal(want, have), (
            f"{name}, fused layers {fused_layers}: step {index // 2} {what} differ by up "
            f"to {(want.float() - have.float()).abs().max().item():.3e}")
    for layer, (want_kv, have_kv) in enumerate(zip(reference_runner.kv_caches,
                                                   fused_runner.kv_caches, strict=True)):
        assert all(torch.equal(w, h) for w, h in zip(want_kv, have_kv, strict=True)), (
            f"{name}: layer {layer}'s K/V cache differs")
    # The in-place residual adds wrote into no weight (the embedding table above all).
    for key, value in model.state_dict().items():
        assert torch.equal(weights[key], value), f"{key} changed during the fused forward"


def test_a_sparse_layer_is_never_offered_the_fused_form() -> None:
    """An ops that fuses anything it is asked about still leaves SparseMoE
    layers to the unfused path: DecoderLayer does not ask for them."""
    model = _random_model("qwen3_moe", torch.float32)
    asked: list[int] = []

    class AskingOps(FusingOps):
        def fuses_dense_layer(self, hidden: torch.Tensor, weights: Sequence[object]) -> bool:
            asked.append(self.layer_of[id(weights[0])])
            return True

    ops = AskingOps(model, range(NUM_LAYERS))
    _run(model, ops)
    assert set(asked) == set(ops.fused) == _dense_layers(model) == {0, 2}
