"""The text side of Qwen2.5-VL and Qwen3-VL against transformers (CPU, fp32).

Tiny random models of transformers' own classes: text prompts through the
whole engine give transformers' greedy tokens; prompts with images, given
the image embeddings transformers' tower computes, give its logits (our
multimodal RoPE positions and rope table, deepstack for Qwen3-VL) and then
its greedy continuation, decoded on the ordinary path at index + delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import protocol as p
from engine.execution.attention_metadata import AttentionMetadata
from engine.loader import load_model
from engine.loader.hf_weights import HFCheckpoint, is_vision_tensor, text_model_config
from engine.models import CausalLM, ModelConfig
from engine.models.mrope import frequency_axes, mrope_positions, mrope_rope_table
from engine.models.multimodal_inputs import MultimodalStepInputs
from tests.engine.in_process import SMALL_STEPS, make_engine, run_to_completion
from tests.engine.test_engine_exactness import hf_greedy
from tests.support.tiny_vl_models import (
    IMAGE_TOKEN,
    MERGE_SIZE,
    VISION_END,
    VISION_START,
    build_tiny_vl_model,
)

ARCHS = ("qwen2_5_vl", "qwen3_vl")
PAGE_SIZE = 16
# Two images of different shapes (frames, rows, cols in patches): 6 tokens each.
GRIDS = ((1, 4, 6), (1, 6, 4))
TEXT = [785, 6722, 315, 9625, 374, 12095, 13, 576]  # ordinary token ids


@dataclass
class Subject:
    arch: str
    path: Path
    hf: torch.nn.Module
    ours: CausalLM


@pytest.fixture(scope="module", params=ARCHS)
def subject(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Subject:
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_vl_model(request.param, path)
    ours = load_model(path, torch.device("cpu"), torch.float32).model
    return Subject(request.param, path, hf, ours)


def image_tokens(grid: tuple[int, int, int]) -> list[int]:
    count = grid[0] * (grid[1] // MERGE_SIZE) * (grid[2] // MERGE_SIZE)
    return [VISION_START] + [IMAGE_TOKEN] * count + [VISION_END]


def layouts() -> dict[str, tuple[list[int], tuple[tuple[int, int, int], ...]]]:
    one, two = image_tokens(GRIDS[0]), image_tokens(GRIDS[1])
    return {
        "image first": (one + TEXT, GRIDS[:1]),
        "two images": (TEXT[:3] + one + TEXT[3:5] + two + TEXT[5:], GRIDS),
        "image last": (TEXT + two, GRIDS[1:]),
        "adjacent images": (TEXT[:2] + one + two + TEXT[2:4], GRIDS),
    }


def pixel_values(hf: torch.nn.Module, grids: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
    vision = hf.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(len(grids)))


def hf_inputs(hf: torch.nn.Module, prompt: list[int], grids) -> dict[str, torch.Tensor]:
    ids = torch.tensor([prompt])
    return {"input_ids": ids, "pixel_values": pixel_values(hf, grids),
            "image_grid_thw": torch.tensor(grids), "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}


@torch.inference_mode()
def tower_outputs(hf: torch.nn.Module, grids) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """transformers' image embeddings [N, H] and deepstack features (Qwen3-VL)."""
    out = hf.model.get_image_features(pixel_values(hf, grids), torch.tensor(grids))
    embeddings = torch.cat(out.pooler_output)
    deepstack = tuple(torch.cat(per_image) for per_image in
                      (getattr(out, "deepstack_features", None) or ()))
    return embeddings, deepstack


class SequenceRunner:
    """One sequence over a paged cache (sequential pages), fed chunk by chunk."""

    def __init__(self, model: CausalLM, num_pages: int = 8) -> None:
        self.model = model
        shape = model.config.kv_cache_shape(num_pages, PAGE_SIZE)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape))
                          for _ in range(model.config.num_layers)]
        self.length = 0

    @torch.inference_mode()
    def logits(self, tokens: list[int], positions: torch.Tensor,
               multimodal: MultimodalStepInputs | None = None) -> torch.Tensor:
        start, end = self.length, self.length + len(tokens)
        self.length = end
        pages = -(-end // PAGE_SIZE)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, len(tokens)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.arange(pages, dtype=torch.int32)[None],
            slot_mapping=torch.arange(start, end), max_query_len=len(tokens), max_seq_len=end,
            query_start_loc_host=(0, len(tokens)), seq_lens_host=(end,))
        hidden = self.model(torch.tensor(tokens), positions, meta, self.kv_caches, multimodal)
        return self.model.compute_logits(hidden)


def prefill(model: CausalLM, prompt: list[int], grids, embeddings: torch.Tensor,
            deepstack: tuple[torch.Tensor, ...], chunk: int) -> tuple[SequenceRunner, torch.Tensor, int]:
    """The prompt in chunks of `chunk` tokens (an image may straddle two), as
    the model runner would slice one request's multimodal inputs; returns the
    runner, every prompt row's logits and the RoPE delta."""
    cfg = model.config
    positions3, delta = mrope_positions(prompt, grids, IMAGE_TOKEN, MERGE_SIZE)
    image_rows = torch.tensor([i for i, token in enumerate(prompt) if token == IMAGE_TOKEN])
    runner = SequenceRunner(model)
    logits = []
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        here = (image_rows >= start) & (image_rows < end)
        table = mrope_rope_table(positions3[:, start:end], model.rope_cache, cfg.mrope_section,
                                 cfg.mrope_interleaved)
        multimodal = MultimodalStepInputs(
            rows=image_rows[here] - start, embeddings=embeddings[here], rope_table=table,
            deepstack=tuple(features[here] for features in deepstack))
        # The step's own positions are ignored beside a rope table: pass nonsense.
        logits.append(runner.logits(prompt[start:end], torch.full((end - start,), 10**6),
                                    multimodal))
    return runner, torch.cat(logits), delta


def test_config_reads_text_config_and_mrope(subject: Subject) -> None:
    cfg = subject.ours.config
    expected = {"qwen2_5_vl": ((2, 3, 3), False, True, False),
                "qwen3_vl": ((4, 2, 2), True, False, True)}[subject.arch]
    assert (cfg.mrope_section, cfg.mrope_interleaved, cfg.attention_bias, cfg.qk_norm) == expected
    assert cfg.tie_word_embeddings == (subject.arch == "qwen3_vl")
    assert (cfg.num_layers, cfg.hidden_size, cfg.head_dim) == (3, 64, 16)


def test_original_qwen2_5_vl_config_layout() -> None:
    """Qwen2.5-VL releases: text fields at the top level, rope_scaling of type mrope."""
    raw = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vocab_size": 1000,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e6,
           "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
           "max_position_embeddings": 4096, "sliding_window": 32768, "use_sliding_window": False,
           "tie_word_embeddings": True, "vision_config": {"depth": 2}}
    cfg = ModelConfig.from_hf_config(text_model_config(raw))
    assert (cfg.architecture, cfg.rope_scaling, cfg.mrope_section) == (
        "Qwen2_5_VLForConditionalGeneration", None, (2, 3, 3))
    assert (cfg.max_position_embeddings, cfg.tie_word_embeddings) == (4096, True)
    with pytest.raises(ValueError, match="mrope_section"):
        ModelConfig.from_hf_config(text_model_config(
            {**raw, "rope_scaling": {"type": "mrope", "mrope_section": [4, 3, 3]}}))


def test_vision_tensors_are_skipped(subject: Subject) -> None:
    # transformers 5 saves Qwen2.5-VL as its releases are (model.layers.*,
    # visual.*) and Qwen3-VL as model.language_model.*, model.visual.*.
    with safe_open(subject.path / "model.safetensors", framework="pt") as handle:
        stored = list(handle.keys())
    tower = "visual." if subject.arch == "qwen2_5_vl" else "model.visual."
    assert any(name.startswith(tower) for name in stored)
    names = [name for name, _, _ in HFCheckpoint(subject.path).tensors()]
    assert len(names) == sum(not is_vision_tensor(name) for name in stored)
    assert all(name.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head"))
               for name in names)
    assert is_vision_tensor("visual.blocks.0.attn.qkv.weight")
    assert is_vision_tensor("model.visual.merger.norm.weight")
    assert not is_vision_tensor("model.language_model.layers.0.mlp.up_proj.weight")


def test_text_prompts_match_transformers_through_the_engine(subject: Subject) -> None:
    core, events = make_engine(subject.path, **SMALL_STEPS)
    prompts = {"short": TEXT[:5], "long": (TEXT * 6)[:45]}
    params = p.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    requests = {name: (prompt, params) for name, prompt in prompts.items()}
    for event in run_to_completion(core, events, requests):
        assert isinstance(event, p.StepOutputs), event
        for output in event.outputs:
            tokens[output.request_id].extend(output.token_ids)
    for name, prompt in prompts.items():
        assert tokens[name] == hf_greedy(subject.hf, prompt, 12), name


@pytest.mark.parametrize("layout", list(layouts()))
def test_positions_match_get_rope_index(subject: Subject, layout: str) -> None:
    prompt, grids = layouts()[layout]
    ids = torch.tensor([prompt])
    expected, deltas = subject.hf.model.get_rope_index(
        ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), image_grid_thw=torch.tensor(grids))
    positions, delta = mrope_positions(prompt, grids, IMAGE_TOKEN, MERGE_SIZE)
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(deltas[0, 0]) < 0


def test_text_only_positions_are_ordinary() -> None:
    positions, delta = mrope_positions(TEXT, (), IMAGE_TOKEN, MERGE_SIZE)
    assert delta == 0 and torch.equal(positions, torch.arange(len(TEXT)).expand(3, -1))
    with pytest.raises(ValueError, match="image tokens"):
        mrope_positions(TEXT + [IMAGE_TOKEN] * 5, GRIDS[:1], IMAGE_TOKEN, MERGE_SIZE)
    with pytest.raises(ValueError, match="grids"):
        mrope_positions(TEXT, GRIDS[:1], IMAGE_TOKEN, MERGE_SIZE)


def test_frequency_axes_follow_transformers() -> None:
    assert frequency_axes((2, 3, 3), interleaved=False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    # Qwen3-VL: t, h, w interleaved up to 3 * sections, the rest on t.
    assert frequency_axes((4, 2, 2), interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    real = frequency_axes((24, 20, 20), interleaved=True)
    assert [int((real == axis).sum()) for axis in range(3)] == [24, 20, 20]


def test_rope_table_matches_transformers_rotary(subject: Subject) -> None:
    prompt, grids = layouts()["two images"]
    positions, _ = mrope_positions(prompt, grids, IMAGE_TOKEN, MERGE_SIZE)
    rotary = subject.hf.model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    cfg = subject.ours.config
    table = mrope_rope_table(positions, subject.ours.rope_cache, cfg.mrope_section,
                             cfg.mrope_interleaved)
    half = table.shape[1] // 2
    assert torch.equal(table[:, :half], cos[0, :, :half])
    assert torch.equal(table[:, half:], sin[0, :, :half])
    # Text positions (all three equal) give the ordinary table's rows.
    text = torch.arange(7).expand(3, -1)
    assert torch.equal(mrope_rope_table(text, subject.ours.rope_cache, cfg.mrope_section,
                                        cfg.mrope_interleaved), subject.ours.rope_cache[:7])


@pytest.mark.parametrize("layout", ["two images", "image last"])
def test_image_prompt_logits_match_transformers(subject: Subject, layout: str) -> None:
    prompt, grids = layouts()[layout]
    with torch.inference_mode():
        expected = subject.hf(**hf_inputs(subject.hf, prompt, grids)).logits[0]
    embeddings, deepstack = tower_outputs(subject.hf, grids)
    assert bool(deepstack) == (subject.arch == "qwen3_vl")
    _, logits, _ = prefill(subject.ours, prompt, grids, embeddings, deepstack, chunk=11)
    assert (logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("subject", ["qwen3_vl"], indirect=True)
def test_deepstack_into_every_layer(subject: Subject) -> None:
    """Features after the last layer too: transformers' text model fed directly."""
    prompt, grids = layouts()["image first"]
    embeddings, _ = tower_outputs(subject.hf, grids)
    rows = torch.tensor([i for i, token in enumerate(prompt) if token == IMAGE_TOKEN])
    generator = torch.Generator().manual_seed(1)
    deepstack = tuple(torch.randn(len(rows), 64, generator=generator) for _ in range(3))
    ids = torch.tensor([prompt])
    positions, _ = mrope_positions(prompt, grids, IMAGE_TOKEN, MERGE_SIZE)
    with torch.inference_mode():
        embeds = subject.hf.model.language_model.embed_tokens(ids)
        embeds[0, rows] = embeddings
        hidden = subject.hf.model.language_model(
            inputs_embeds=embeds, position_ids=positions[:, None], visual_pos_masks=ids == IMAGE_TOKEN,
            deepstack_visual_embeds=list(deepstack)).last_hidden_state
        expected = subject.hf.lm_head(hidden)[0]
    _, logits, _ = prefill(subject.ours, prompt, grids, embeddings, deepstack, chunk=len(prompt))
    assert (logits - expected).abs().max().item() <= 1e-4


def test_generation_after_images_matches_transformers(subject: Subject) -> None:
    prompt, grids = layouts()["two images"]
    new_tokens = 8
    with torch.inference_mode():
        generated = subject.hf.generate(**hf_inputs(subject.hf, prompt, grids),
                                        max_new_tokens=new_tokens, do_sample=False)
    expected = generated[0, len(prompt):].tolist()
    embeddings, deepstack = tower_outputs(subject.hf, grids)
    runner, logits, delta = prefill(subject.ours, prompt, grids, embeddings, deepstack, chunk=9)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < new_tokens:
        # Decode is a text step: the ordinary rope table at index + delta.
        position = torch.tensor([runner.length + delta])
        tokens.append(int(runner.logits(tokens[-1:], position)[-1].argmax()))
    assert tokens == expected
