"""Qwen3-Next and Qwen3.5 (hybrid Gated DeltaNet + gated attention) against transformers.

Tiny random-weight models, float32 on the CPU, built and saved by
transformers and loaded into our classes by their checkpoint names. A
test-side runner drives the model directly (the engine's own scheduling is
tested in test_hybrid_serving.py): it pages the full-attention layers' KV
cache from a shuffled free list and gives each sequence a row of the
recurrent state pools, which start out as noise, so a missed "fresh" flag shows.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.recurrent_state import RecurrentStatePools
from engine.models import model_class
from engine.models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from engine.models.qwen3_next import (
    HybridCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)
from engine.models.shared_expert_moe import SharedExpertMoE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
VOCAB = 512
PAGE_SIZE = 16
PROMPT_LEN = 40
NEW_TOKENS = 8
TOL = 1e-4
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, initializer_range=0.1,
    tie_word_embeddings=False,
)
_CLASSES: dict[str, type[HybridCausalLM]] = {
    "qwen3_next": Qwen3NextForCausalLM, "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM}


def _hf_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers import Qwen3NextForCausalLM as HFModel

        # Layer 2 dense (mlp_only_layers), the others routed + shared expert.
        config = Qwen3NextConfig(
            **_COMMON, num_hidden_layers=4,
            layer_types=[LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION],
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_only_layers=[2], norm_topk_prob=True)
    elif family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeForCausalLM as HFModel,
        )

        # Every layer routed (top-2 of 4, always renormalised) + a shared expert.
        # No intermediate_size: transformers' Qwen3.5-MoE config has none.
        common = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}
        config = Qwen3_5MoeTextConfig(
            **common, num_hidden_layers=4, full_attention_interval=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        from transformers.models.qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM as HFModel

        config = Qwen3_5TextConfig(**_COMMON, num_hidden_layers=3, full_attention_interval=3)
    model = HFModel(config).eval()
    # Zero-centred norms start at 0 (scale 1): give them values so the "+ 1" shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape) * 0.2)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[HybridCausalLM, torch.nn.Module]:
    """(ours, transformers') with the same weights, ours filled from the saved
    checkpoint through weight_destinations, as the loader fills served models."""
    hf = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory, safe_serialization=True)
    cfg = json.loads((directory / "config.json").read_text())
    cls = _CLASSES[request.param]
    ours = cls(ModelConfig.from_hf_config(cfg, model_cls=cls), "cpu", torch.float32)
    _fill(ours, directory)
    return ours, hf


def _fill(model: HybridCausalLM, directory: Path) -> None:
    destinations = model.weight_destinations()
    with torch.no_grad(), safe_open(directory / "model.safetensors", "pt") as handle:
        for name in handle.keys():
            dest = destinations.pop(name)  # KeyError: a tensor we do not map
            tensor = handle.get_tensor(name)
            assert tuple(tensor.shape) == tuple(dest.shape), name
            dest.copy_(tensor)
    assert not destinations, f"unfilled: {sorted(destinations)[:5]}"


class HybridRunner:
    """The engine's part: paged KV for full-attention layers, a state slot per
    sequence (handed out from the top down) in the linear-attention layers."""

    def __init__(self, model: HybridCausalLM, num_pages: int = 32, num_slots: int = 4) -> None:
        self.model = model
        cfg = model.config
        gen = torch.Generator().manual_seed(1)
        pools = RecurrentStatePools(cfg, lanes=num_slots, checkpoints=0,
                                    device=torch.device("cpu"), dtype=torch.float32)
        for pool in (*pools.conv, *pools.states):
            pool.copy_(torch.randn(pool.shape, generator=gen))
        self.pools = pools
        shape = cfg.kv_cache_shape(num_pages, PAGE_SIZE)
        self.caches = [(torch.zeros(shape), torch.zeros(shape))
                       for _ in range(cfg.num_attention_layers)]
        self.free_pages = torch.randperm(num_pages, generator=gen).tolist()
        self.free_slots = list(range(num_slots))
        self.pages: dict[int, list[int]] = defaultdict(list)
        self.lengths: dict[int, int] = defaultdict(int)
        self.slots: dict[int, int] = {}

    def logits(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        """work: (sequence id, its new tokens) per sequence -> logits [T, vocab]."""
        ids: list[int] = []
        positions: list[int] = []
        kv_slots: list[int] = []
        starts, seq_lens, state_slots, fresh = [0], [], [], []
        for seq, tokens in work:
            start, end = self.lengths[seq], self.lengths[seq] + len(tokens)
            if seq not in self.slots:
                self.slots[seq] = self.free_slots.pop()
            pages = self.pages[seq]
            while len(pages) * PAGE_SIZE < end:
                pages.append(self.free_pages.pop())
            kv_slots += [pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
                         for p in range(start, end)]
            ids += tokens
            positions += range(start, end)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            state_slots.append(self.slots[seq])
            fresh.append(start == 0)
            self.lengths[seq] = end
        width = max(len(self.pages[seq]) for seq, _ in work)
        tables = [self.pages[seq] + [0] * (width - len(self.pages[seq])) for seq, _ in work]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(kv_slots, dtype=torch.int64),
            max_query_len=max(len(tokens) for _, tokens in work),
            max_seq_len=max(seq_lens),
            query_start_loc_host=tuple(starts),
            seq_lens_host=tuple(seq_lens),
            state_slots=torch.tensor(state_slots, dtype=torch.int64),
            state_fresh=torch.tensor(fresh, dtype=torch.bool),
        )
        # Several runners may share the model: each brings its own state.
        self.model.attach_state(self.pools)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.caches)
            return self.model.compute_logits(hidden)


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


def _max_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got - expected).abs().max().item()


def test_prompt_logits_in_one_pass_match_transformers(pair) -> None:
    ours, hf = pair
    prompt = _prompt(2)
    diff = _max_diff(HybridRunner(ours).logits([(0, prompt)]), _hf_logits(hf, prompt))
    assert diff < TOL, f"max |logit diff| {diff:.2e}"


def test_chunked_prefill_and_decode_match_transformers_greedy(pair) -> None:
    """7 + 13 + 20 prompt tokens, then greedy decode steps one token at a time,
    against transformers recomputing the whole sequence for every token."""
    ours, hf = pair
    prompt = _prompt(3)
    runner = HybridRunner(ours)
    chunks = [prompt[:7], prompt[7:20], prompt[20:]]
    prefill = torch.cat([runner.logits([(5, chunk)]) for chunk in chunks])
    diff = _max_diff(prefill, _hf_logits(hf, prompt))
    assert diff < TOL, f"chunked prefill: max |logit diff| {diff:.2e}"
    ours_tokens = [int(prefill[-1].argmax())]
    while len(ours_tokens) < NEW_TOKENS:
        ours_tokens.append(int(runner.logits([(5, ours_tokens[-1:])])[-1].argmax()))
    hf_tokens: list[int] = []
    while len(hf_tokens) < NEW_TOKENS:
        hf_tokens.append(int(_hf_logits(hf, prompt + hf_tokens)[-1].argmax()))
    assert ours_tokens == hf_tokens


def test_batched_sequences_equal_each_alone(pair) -> None:
    """A continuing sequence and a fresh one in one step (then both decoding)
    give what each gives alone: slots and fresh flags keep them apart."""
    ours, _ = pair
    first, second = _prompt(4, 16), _prompt(5, 9)
    together = HybridRunner(ours)
    together.logits([(0, first[:10])])
    mixed = together.logits([(0, first[10:]), (1, second)])
    decode = together.logits([(1, [7]), (0, [11])])

    alone_first, alone_second = HybridRunner(ours), HybridRunner(ours)
    alone_first.logits([(0, first[:10])])
    expected = torch.cat([alone_first.logits([(0, first[10:])]),
                          alone_second.logits([(1, second)])])
    expected_decode = torch.cat([alone_second.logits([(1, [7])]),
                                 alone_first.logits([(0, [11])])])
    assert _max_diff(mixed, expected) < 1e-5
    assert _max_diff(decode, expected_decode) < 1e-5


def test_released_qwen3_next_config_layout() -> None:
    """Qwen3-Next-80B's config.json keys: full_attention_interval instead of
    layer_types, partial_rotary_factor at the top level."""
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 5120, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "rope_theta": 10000000,
        "partial_rotary_factor": 0.25, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 262144,
    }
    config = ModelConfig.from_hf_config(cfg, model_cls=Qwen3NextForCausalLM)
    assert config.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,) + \
        (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert config.rotary_dim == 64
    assert config.linear_attention is not None
    assert config.linear_attention.conv_channels == 2 * 16 * 128 + 32 * 128
    assert config.moe is not None and config.moe.shared_expert_intermediate_size == 512
    assert config.moe.sparse_layers == tuple(range(8))


def test_built_layers_follow_the_config(pair) -> None:
    ours, _ = pair
    cfg = ours.config
    for index, layer in enumerate(ours.layers):
        names = layer.weight_destinations(f"model.layers.{index}")
        mixer = "linear_attn" if cfg.is_linear_attention(index) else "self_attn"
        assert any(f".{mixer}." in name for name in names)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(index)
        assert isinstance(layer.mlp, SharedExpertMoE) == sparse


def test_hybrid_classes_are_served() -> None:
    for name, cls in _CLASSES.items():
        assert model_class(cls.__name__) is cls, name


def test_other_architectures_still_refuse_partial_rotary() -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial rotary"):
        ModelConfig.from_hf_config(cfg)
