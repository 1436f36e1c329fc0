"""Our models against Hugging Face transformers: same greedy tokens, same logits.

Each architecture runs as a real trained model (SmolLM2-135M, GGUF) or a tiny
random-weight one (qwen3, qwen2, llama). Prompts go through the paged cache in
chunks of 7 tokens with 16-token pages, so chunks straddle page boundaries,
and pages are handed out in a shuffled order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.execution.attention_metadata import AttentionMetadata
from engine.models import CausalLM
from tests.engine import in_process

PAGE_SIZE = 16
CHUNK = 7
NEW_TOKENS = 24
LONG_TEXT = (
    "The history of railways began with wooden wagonways in the mines of sixteenth-century "
    "Germany, where horses pulled carts along planks. Iron rails arrived in England two "
    "centuries later, and in 1804 Richard Trevithick ran the first steam locomotive on them. "
    "Roundhouses, circular buildings with a turntable at their centre, let engineers store "
    "and service many locomotives in a small yard: an engine rolled onto the turntable, "
    "turned to face an empty stall, and backed in for repairs, coal and water. By the end of "
    "the nineteenth century every major junction had one, and the largest held more than "
    "forty engines under a single roof. Diesel traction made most of them redundant, yet a "
    "few survive as museums, concert halls and markets, still arranged around the turntable "
    "that gave them their shape."
)


class PagedRunner:
    """Feeds sequences through a CausalLM over a paged cache, standing in for the
    engine's KV manager: pages come from a shuffled free list as sequences grow."""

    def __init__(self, model: CausalLM, num_pages: int = 48, seed: int = 0) -> None:
        self.model = model
        cfg = model.config
        shape = cfg.kv_cache_shape(num_pages, PAGE_SIZE)
        dtype = model.embed_tokens.dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(cfg.num_layers)
        ]
        self.free_pages = torch.randperm(
            num_pages, generator=torch.Generator().manual_seed(seed)
        ).tolist()
        self.pages: dict[int, list[int]] = defaultdict(list)
        self.lengths: dict[int, int] = defaultdict(int)

    def step(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        """work: (sequence id, its new token ids) per sequence -> hidden states [T, H]."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens = [0], []
        for seq, tokens in work:
            start, end = self.lengths[seq], self.lengths[seq] + len(tokens)
            pages = self.pages[seq]
            while len(pages) * PAGE_SIZE < end:
                pages.append(self.free_pages.pop())
            slots += [pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(start, end)]
            ids += tokens
            positions += range(start, end)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self.lengths[seq] = end
        width = max(len(self.pages[seq]) for seq, _ in work)
        tables = [self.pages[seq] + [0] * (width - len(self.pages[seq])) for seq, _ in work]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(tokens) for _, tokens in work),
            max_seq_len=max(seq_lens),
            query_start_loc_host=tuple(starts),
            seq_lens_host=tuple(seq_lens),
        )
        with torch.inference_mode():
            return self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches)

    def logits(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        hidden = self.step(work)
        with torch.inference_mode():
            return self.model.compute_logits(hidden)


def greedy_generate(model: CausalLM, prompt: list[int]) -> list[int]:
    runner = PagedRunner(model)
    for i in range(0, len(prompt), CHUNK):
        logits = runner.logits([(0, prompt[i : i + CHUNK])])
    out: list[int] = []
    while True:
        out.append(int(logits[-1].argmax()))
        if len(out) == NEW_TOKENS:
            return out
        logits = runner.logits([(0, out[-1:])])


@dataclass
class Subject:
    name: str
    ours: CausalLM
    hf: torch.nn.Module
    prompts: list[list[int]]  # 5, ~40 and ~150 tokens


def _prompts(tokenizer, chat: bool) -> list[list[int]]:
    def chat_ids(text: str) -> list[int]:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    short = tokenizer("The capital of France is")["input_ids"][:5]
    if chat:
        return [
            short,
            chat_ids("What is the capital of France? Answer in one short sentence."),
            chat_ids(LONG_TEXT + " Summarize this in two sentences."),
        ]
    long_ids = tokenizer(LONG_TEXT)["input_ids"]
    return [short, long_ids[:40], long_ids[:150]]


@pytest.fixture(scope="module", params=["smollm2", "qwen3", "qwen2", "llama"])
def subject(request: pytest.FixtureRequest) -> Subject:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = request.param
    if name == "smollm2":
        # transformers reads the GGUF slowly: its model and tokenizer are shared session-wide.
        path: Path = request.getfixturevalue("smollm2_gguf")
        hf = request.getfixturevalue("smollm2_reference")
        prompts = _prompts(request.getfixturevalue("hf_smollm2"), chat=True)
    else:
        path = request.getfixturevalue("tiny_model_factory")(name)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        prompts = _prompts(AutoTokenizer.from_pretrained(path), chat=False)
    hf.eval()
    # SmolLM2's GGUF takes seconds to read: its weights are the engine tests'
    # (tests/engine/in_process.py), which this module only runs forward.
    ours = in_process.shared_weights(path).model
    return Subject(name, ours, hf, prompts)


@pytest.mark.parametrize("prompt_index", [0, 1, 2])
def test_greedy_tokens_match_transformers(subject: Subject, prompt_index: int) -> None:
    prompt = subject.prompts[prompt_index]
    with torch.inference_mode():
        # eos_token_id=None: compare all 24 tokens even past an end of turn.
        reference = subject.hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    ours = greedy_generate(subject.ours, prompt)
    assert len(reference) == NEW_TOKENS
    first_diff = next(
        (i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), None
    )
    assert ours == reference, (
        f"{subject.name}, {len(prompt)}-token prompt: first difference at token {first_diff}\n"
        f"ours: {ours}\nhf:   {reference}"
    )


def test_flat_batch_matches_sequences_run_alone(subject: Subject) -> None:
    short, medium, long = subject.prompts
    split = 20  # the medium prompt's second chunk runs over a cached prefix
    batch = PagedRunner(subject.ours, num_pages=40, seed=1)
    first = batch.logits([(0, short), (1, medium[:split]), (2, long[:-1])])
    next_token = int(first[len(short) - 1].argmax())
    second = batch.logits([(0, [next_token]), (1, medium[split:]), (2, long[-1:])])

    # The same tokens, each sequence alone in one prefill over fresh pages.
    alone = [
        PagedRunner(subject.ours, seed=2).logits([(0, tokens)])
        for tokens in ([*short, next_token], medium, long)
    ]
    n_short, n_long = len(short), len(long)
    expected_first = torch.cat([alone[0][:n_short], alone[1][:split], alone[2][: n_long - 1]])
    expected_second = torch.cat([alone[0][n_short:], alone[1][split:], alone[2][n_long - 1 :]])
    for got, expected, step in ((first, expected_first, 1), (second, expected_second, 2)):
        diff = (got - expected).abs().max().item()
        assert diff < 1e-4, f"{subject.name} step {step}: batched logits differ by up to {diff:.2e}"
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), (
            f"{subject.name} step {step}: argmax differs"
        )


def test_prompt_logits_close_to_transformers(subject: Subject) -> None:
    prompt = subject.prompts[2]
    with torch.inference_mode():
        reference = subject.hf(torch.tensor([prompt])).logits[0].float()
    ours = PagedRunner(subject.ours).logits([(0, prompt)])
    diff = (ours - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert diff < 1e-3, (
        f"{subject.name}: max |logit diff| {diff:.2e} over {len(prompt)} tokens (logits up to {scale:.1f})"
    )
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree == 1.0, (
        f"{subject.name}: argmax agrees on {agree:.1%} of positions (max diff {diff:.2e})"
    )
