"""Tensor parallelism on the CPU: 2 and 4 ranks as processes over gloo give the
single-device model's greedy tokens, and its logits within float32
reduction-order error.

Subjects cover the splits: Qwen3 (q/k norms, tied embeddings, 4 q heads over
2 KV heads: split evenly at 2 ranks, each KV head replicated on two ranks at
4), Qwen2 (random q/k/v biases, untied), Llama (untied), a Llama with one KV
head (replicated on every rank), random biases on q/k/v and o_proj (o_proj's
added once) and a 1001-token tied vocabulary that does not split evenly, and
a Q8_0 GGUF loaded dequantized (llama.cpp's q/k row order undone before the
split).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.loader import load_model
from engine.models import build_model
from engine.models.config import LinearAttentionConfig, ModelConfig, MoEConfig
from engine.parallel.sharding import ShardedSlot, ShardPlan
from engine.parallel.tensor_parallel import SINGLE_RANK, TensorParallel
from tests.engine.quantized_gguf import MATRICES, write_quantized_gguf
from tests.engine.tensor_parallel_ranks import Subject, Trace, generate, run_ranks

CPU = torch.device("cpu")
PROMPT_TOKENS = 20
# float32 logits of the same weights with the dot products of o_proj,
# down_proj (and the all-reduce) summed in another order: each sum moves by a
# few ulps of its terms, carried through two layers and the norms. Measured:
# at most 7.5e-6 on logits up to 5.4 in magnitude; 1e-4 leaves room, yet a
# misplaced slice, head or bias moves logits by 1e-2 and more.
LOGIT_TOLERANCE = 1e-4


def _save_random_model(config: object, target: Path) -> Path:
    """A transformers model of config with every bias random too (transformers
    starts them at zero, where a bias added once or on every rank look alike)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(target, safe_serialization=True)
    return target


def _prompt(vocab_size: int, seed: int) -> tuple[int, ...]:
    # Ids across the whole vocabulary: every rank's embedding slice is read.
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab_size, (PROMPT_TOKENS,), generator=generator).tolist())


@pytest.fixture(scope="module")
def subjects(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> list[Subject]:
    import transformers

    root = tmp_path_factory.mktemp("tensor-parallel")
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=512, initializer_range=0.1)
    qwen2 = _save_random_model(transformers.Qwen2Config(
        **small, vocab_size=4096, num_key_value_heads=2, tie_word_embeddings=False),
        root / "qwen2-bias")
    llama_mqa = _save_random_model(transformers.LlamaConfig(
        **small, vocab_size=1001, num_key_value_heads=1, attention_bias=True,
        tie_word_embeddings=True), root / "llama-mqa-bias")
    gguf = write_quantized_gguf(root / "llama-q8_0.gguf", {name: T.Q8_0 for name in MATRICES})
    paths = {"qwen3": tiny_model_factory("qwen3"), "llama": tiny_model_factory("llama"),
             "qwen2_bias": qwen2, "llama_mqa_bias": llama_mqa, "gguf_q8_0": gguf}
    return [Subject(name, path, _prompt(load_config(path).vocab_size, seed))
            for seed, (name, path) in enumerate(paths.items())]


def load_config(path: Path) -> ModelConfig:
    from engine.loader import open_checkpoint

    return open_checkpoint(path).config


@pytest.fixture(scope="module")
def single_device(subjects: list[Subject]) -> dict[str, Trace]:
    return {s.name: generate(load_model(s.path, CPU, torch.float32).model, s.prompt)
            for s in subjects}


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest, subjects: list[Subject],
          tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Trace]]]:
    world = request.param
    return world, run_ranks(world, subjects, tmp_path_factory.mktemp(f"ranks{world}"))


NAMES = ["qwen3", "llama", "qwen2_bias", "llama_mqa_bias", "gguf_q8_0"]


@pytest.mark.parametrize("name", NAMES)
def test_ranks_match_the_single_device_model(name: str, ranks, single_device) -> None:
    world, traces = ranks
    reference = single_device[name]
    ours = traces[0][name]
    for rank, by_name in enumerate(traces):
        trace = by_name[name]
        assert trace.tokens == reference.tokens, (
            f"{name} at {world} ranks: rank {rank} chose {trace.tokens}, one device "
            f"{reference.tokens}")
    assert len(ours.logits) == len(reference.logits)
    for step, (got, expected) in enumerate(zip(ours.logits, reference.logits, strict=True)):
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff < LOGIT_TOLERANCE, (
            f"{name} at {world} ranks, step {step}: logits differ by up to {diff:.2e}")


def test_world_size_one_is_the_single_device_path(subjects: list[Subject],
                                                  single_device: dict[str, Trace]) -> None:
    # No process group exists in this process: a collective that reached
    # torch.distributed would raise.
    assert not torch.distributed.is_initialized()
    tp = TensorParallel(rank=0, world_size=1)
    x = torch.randn(3, 8)
    assert tp.all_reduce(x) is x and tp.all_gather_last_dim(x) is x
    for subject in subjects:
        model = load_model(subject.path, CPU, torch.float32, tp=tp).model
        assert not any(isinstance(dest, ShardedSlot)
                       for dest in model.weight_destinations().values())
        trace = generate(model, subject.prompt)
        reference = single_device[subject.name]
        assert trace.tokens == reference.tokens
        assert all(torch.equal(a, b) for a, b in zip(trace.logits, reference.logits,
                                                      strict=True)), subject.name


def test_each_rank_holds_its_heads_and_vocab_slice(tiny_qwen3_dir: Path) -> None:
    config = load_config(tiny_qwen3_dir)  # 4 q heads, 2 KV heads, head_dim 16
    dim = config.head_dim
    plans = [ShardPlan.of(config, TensorParallel(rank, 4)) for rank in range(4)]
    assert [p.q_rows.start // dim for p in plans] == [0, 1, 2, 3]
    # q heads 0-1 read KV head 0 and q heads 2-3 KV head 1, as on one device.
    assert [p.kv_rows.start // dim for p in plans] == [0, 0, 1, 1]
    assert {(p.config.num_heads, p.config.num_kv_heads) for p in plans} == {(1, 1)}
    assert sum(p.vocab_rows.length for p in plans) == config.vocab_size
    two = [ShardPlan.of(config, TensorParallel(rank, 2)) for rank in range(2)]
    assert [(p.kv_rows.start // dim, p.config.num_kv_heads) for p in two] == [(0, 1), (1, 1)]
    # The KV cache of a rank holds its heads only.
    model = build_model(config, "meta", torch.float32, tp=TensorParallel(1, 4))
    assert model.config.kv_cache_shape(8, 16) == (8, 16, 1, dim)
    assert model.config.vocab_size == config.vocab_size  # the gathered logits' width
    assert tuple(model.embed_tokens.shape) == (config.vocab_size // 4, config.hidden_size)
    assert tuple(model.layers[0].mlp.gate_up_weight.shape) == (
        2 * config.intermediate_size // 4, config.hidden_size)


def _refusal(config: ModelConfig, world: int) -> str:
    with pytest.raises(ValueError) as caught:
        build_model(config, "meta", torch.float32, tp=TensorParallel(0, world))
    return str(caught.value)


def test_shapes_that_do_not_split_are_refused(tiny_qwen3_dir: Path) -> None:
    config = load_config(tiny_qwen3_dir)
    message = _refusal(config, 3)
    assert "does not split across 3 tensor-parallel ranks" in message
    assert "4 attention heads" in message
    # Three KV heads neither split over two ranks nor replicate evenly on them.
    six_heads = dataclasses.replace(config, num_heads=6, num_kv_heads=3)
    assert "3 KV heads" in _refusal(six_heads, 2)
    with pytest.raises(ValueError, match="4 attention heads"):
        load_model(tiny_qwen3_dir, CPU, torch.float32, tp=TensorParallel(0, 3))


def test_mixture_of_experts_and_hybrid_models_are_refused(tiny_qwen3_dir: Path) -> None:
    config = load_config(tiny_qwen3_dir)
    moe = dataclasses.replace(
        config, architecture="Qwen3MoeForCausalLM",
        moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=32,
                      normalize_topk=True, sparse_layers=(0, 1)))
    assert ("not supported yet for mixture-of-experts models (Qwen3MoeForCausalLM)"
            in _refusal(moe, 2))
    hybrid = dataclasses.replace(
        config, architecture="Qwen3_5ForCausalLM",
        layer_types=("linear_attention", "full_attention"),
        linear_attention=LinearAttentionConfig(num_key_heads=2, num_value_heads=4,
                                               key_head_dim=16, value_head_dim=16,
                                               conv_kernel_size=4))
    assert ("not supported yet for hybrid (linear-attention) models (Qwen3_5ForCausalLM)"
            in _refusal(hybrid, 2))
    # At one rank both build as before.
    build_model(moe, "meta", torch.float32, tp=SINGLE_RANK)


def test_packed_quantized_weights_are_refused(tmp_path: Path) -> None:
    from tests.support.fp8_checkpoints import write_float_qwen3, write_fp8_copy

    gguf = write_quantized_gguf(tmp_path / "q8_0.gguf", {name: T.Q8_0 for name in MATRICES})
    with pytest.raises(ValueError, match=r"not quantized GGUF blocks \(--gguf-weights packed\)"):
        load_model(gguf, CPU, torch.float32, packed_quant=True, tp=TensorParallel(0, 2))
    fp8 = write_fp8_copy(write_float_qwen3(tmp_path / "float"), tmp_path / "fp8",
                         per_tensor=True)
    with pytest.raises(ValueError, match="not FP8 weights"):
        load_model(fp8, CPU, torch.float32, packed_quant=True, tp=TensorParallel(0, 2))
