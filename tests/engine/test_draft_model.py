"""Speculative decoding with a draft model (--spec draft,
engine/sampling/draft_model.py): the drafter's own KV bookkeeping, whole
engines whose greedy output must not change by a token, and the refusal of a
draft model of another vocabulary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.loader import load_model
from engine.sampling.draft_model import DraftModelDrafter
from engine.sampling.drafter import DraftRow
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion
from tests.support.fixtures import QWEN3_TOKENIZER_FILES, qwen3_tokenizer
from tests.support.tiny_models import QWEN_BOS, QWEN_EOS, QWEN_VOCAB


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 narrower than tiny_qwen3_dir (hidden size 48, not 64;
    three heads, one KV head) with the same tokenizer: a draft model for it."""
    import transformers

    torch.manual_seed(1)
    config = transformers.Qwen3Config(
        vocab_size=QWEN_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-6, initializer_range=0.1, rope_theta=1_000_000.0,
        tie_word_embeddings=True, bos_token_id=QWEN_BOS, eos_token_id=QWEN_EOS)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    target = tmp_path_factory.mktemp("draft") / "tiny-qwen3-draft"
    model.save_pretrained(target, safe_serialization=True)
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copyfile(qwen3_tokenizer() / name, target / name)
    return target


def greedy(max_tokens: int, **more: object) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, **more)  # type: ignore[arg-type]


def run(core: EngineCore, events: list[p.EngineEvent],
        requests: dict[str, tuple[list[int], p.SamplingParams]]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {name: [] for name in requests}
    for event in run_to_completion(core, events, requests):
        assert isinstance(event, p.StepOutputs), event
        for output in event.outputs:
            found[output.request_id] += output.token_ids
    return found


def assert_all_freed(core: EngineCore) -> None:
    pool = core.scheduler.kv.pool
    core.scheduler.check_invariants()
    assert pool.num_used == 0 and core.scheduler.kv.outstanding == 0
    drafter = core.scheduler.drafter
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.num_free_pages == drafter.num_pages  # every request's draft KV freed


def prompts(count: int, length: int) -> list[list[int]]:
    # Ordinary token ids, a different stretch per request.
    return [list(range(1000 + 97 * i, 1000 + 97 * i + length)) for i in range(count)]


# ---- the drafter alone -------------------------------------------------------------


def drafter_of(path: Path, num_pages: int) -> DraftModelDrafter:
    loaded = load_model(path, torch.device("cpu"), torch.float32)
    return DraftModelDrafter(loaded.model, num_pages=num_pages, page_size=8, max_step_tokens=16,
                             vocab_limit=loaded.config.vocab_size, device=torch.device("cpu"))


def test_a_rewound_sequence_drafts_as_if_seen_fresh(small_draft_dir: Path) -> None:
    drafter = drafter_of(small_draft_dir, num_pages=32)
    tokens = prompts(1, 30)[0]  # over several forward passes of 16 tokens
    first = drafter.propose_batch([DraftRow("a", tokens, 4)])[0]
    assert len(first) == 4
    # The target kept the first guess, disagreed with the second, and the row
    # went on without drafts: the draft's K/V of its guesses after the first
    # must not be used.
    other = (first[1] + 1) % 1000
    rewound = [*tokens, first[0], other, 7]
    again = drafter.propose_batch([DraftRow("a", rewound, 3), DraftRow("b", tokens[:20], 2)])
    fresh = drafter_of(small_draft_dir, num_pages=32)
    assert again == [fresh.propose(rewound, 3), fresh.propose(tokens[:20], 2)]
    assert again[0] == drafter.propose(rewound, 3)
    # Nothing new: the newest token is fed again, the same guesses come out.
    assert drafter.propose_batch([DraftRow("a", rewound, 3)])[0] == again[0]
    drafter.forget("a")
    drafter.forget("b")
    assert drafter.num_free_pages == 32


def test_a_short_pool_takes_pages_from_the_least_recent_request(small_draft_dir: Path) -> None:
    # Five pages: one sequence of 30 tokens and its 4 guesses (33 positions).
    drafter = drafter_of(small_draft_dir, num_pages=5)
    a, b = prompts(2, 30)
    want_b = drafter_of(small_draft_dir, num_pages=5).propose(b, 4)
    assert len(drafter.propose_batch([DraftRow("a", a, 4)])[0]) == 4
    assert drafter.propose_batch([DraftRow("b", b, 4)])[0] == want_b  # a gave its pages up
    # Both in one call: the second does not fit beside the first, and gets no draft.
    both = drafter.propose_batch([DraftRow("b", b, 4), DraftRow("a", a, 4)])
    assert both[0] == want_b and both[1] == []
    assert drafter.propose_batch([DraftRow("c", a, 40)])[0] == []  # never fits


# ---- whole engines -------------------------------------------------------------------


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_qwen3_dir: Path) -> None:
    # A small pool: requests are preempted and recomputed, and the draft's
    # pool (as many pages as the target's) runs short too.
    small = {"kv_capacity_tokens": 96, "output_window": 0, "max_context": 96}
    batch = {f"r{i}": (prompt, greedy(40, ignore_eos=True))
             for i, prompt in enumerate(prompts(3, 37))}
    plain = in_process.make_engine(tiny_qwen3_dir, **{**SMALL_STEPS, **small})
    core, events = in_process.make_engine(
        tiny_qwen3_dir, **{**SMALL_STEPS, **small}, spec="draft",
        draft_model=str(tiny_qwen3_dir), draft_tokens=4)
    assert run(core, events, batch) == run(*plain, batch)
    assert core.scheduler.num_preemptions > 0
    stats = core._stats
    # Same weights, same greedy choices: every guess is the target's token.
    assert stats.draft_accepted_tokens_total == stats.draft_tokens_total > 20, stats
    assert_all_freed(core)
    # A sleep drops the draft's memory with the engine's; after a wake it drafts as before.
    drafted = stats.draft_tokens_total
    core.handle(p.Sleep("host"))
    core.handle(p.Wake())
    again = {name: (prompt, params) for name, (prompt, params) in batch.items() if name != "r2"}
    assert run(core, events, again) == run(*plain, again)
    assert stats.draft_accepted_tokens_total == stats.draft_tokens_total > drafted
    assert_all_freed(core)


def test_a_smaller_draft_model_leaves_greedy_output_unchanged(
        tiny_qwen3_dir: Path, small_draft_dir: Path) -> None:
    first, second, third = prompts(3, 29)
    batch = {
        "a": (first, greedy(30, ignore_eos=True)),
        "b": (second, greedy(25, ignore_eos=True)),
        "short": (third[:5], greedy(9, ignore_eos=True)),
        "sampled": (second, p.SamplingParams(max_tokens=20, temperature=0.8, seed=5,
                                             ignore_eos=True)),
    }
    plain = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS)
    core, events = in_process.make_engine(tiny_qwen3_dir, **SMALL_STEPS, spec="draft",
                                          draft_model=str(small_draft_dir), draft_tokens=3)
    got, want = run(core, events, batch), run(*plain, batch)
    assert len(got.pop("sampled")) == len(want.pop("sampled"))
    assert got == want
    assert core._stats.draft_tokens_total > 0
    assert_all_freed(core)


def test_a_draft_model_of_another_vocabulary_is_refused(
        tiny_qwen3_dir: Path, smollm2_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot draft for .*tiny-qwen3.*49152") as refused:
        in_process.make_engine(tiny_qwen3_dir, spec="draft", draft_model=str(smollm2_gguf))
    assert str(smollm2_gguf) in str(refused.value)
    # The same sizes, one token spelled otherwise.
    other = tmp_path / "renamed-token"
    shutil.copytree(tiny_qwen3_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token = next(name for name, index in vocab.items() if index == 1234)
    vocab["renamed"] = vocab.pop(token)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"token 1234 is .* in the target and 'renamed'"):
        in_process.make_engine(tiny_qwen3_dir, spec="draft", draft_model=str(other))
    with pytest.raises(ValueError, match="--spec draft and --draft-model go together"):
        p.EngineOptions(spec="draft")


def test_the_vocabulary_check_opens_each_checkpoint_once(
        smollm2_gguf: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.loader import open_checkpoint, vocabulary

    opened: list[Path] = []

    def counting_open(path: Path):  # type: ignore[no-untyped-def]
        opened.append(path)
        return open_checkpoint(path)

    monkeypatch.setattr(vocabulary, "open_checkpoint", counting_open)
    # Two GGUFs: the token lists come from the one read of each file.
    assert vocabulary.vocabulary_mismatch(smollm2_gguf, smollm2_gguf) is None
    assert opened == [smollm2_gguf, smollm2_gguf]
    opened.clear()
    why = vocabulary.vocabulary_mismatch(tiny_qwen3_dir, smollm2_gguf)
    assert why is not None and "49152" in why
    assert opened == [tiny_qwen3_dir, smollm2_gguf]
