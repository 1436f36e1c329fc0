"""Speculative decoding for rows whose logits are changed or read at each
position: logit bias, penalties (presence, frequency, repetition, windowed)
and log probabilities (top alternatives, named token ids, "processed" mode).

First the draft positions alone (Sampler.draw_targets with
PenaltyState.apply_ahead, DraftLogprobs) against plain decoding at the same
contexts, over several verify steps whose accepted tokens the penalty lanes
must then count; then whole engines on SmolLM2 copying a passage, whose
tokens and log probabilities must not change under speculation while drafts
are accepted, alone, in mixed batches and through preemptions."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.sampling.draft_logprobs import DraftLogprobs, draft_contexts
from engine.sampling.drafter import may_draft
from engine.sampling.logprobs import RowLogprobs
from engine.sampling.penalty_state import PenaltyState
from engine.sampling.processed_logprobs import use_processed
from engine.sampling.sampler import Sampler
from engine.scheduling.core import EngineCore
from engine.scheduling.sequence import SeqStatus, Sequence
from tests.engine.in_process import run_to_completion
from tests.engine.test_penalty_state import KINDS
from tests.engine.test_speculation import (
    COPY,
    SPEC,
    assert_no_pages_held,
    chat_prompt,
    engine,
    greedy,
)

CPU = torch.device("cpu")
VOCAB = 40
# CPU fp32: a verify chunk's logits differ from a decode step's by rounding
# only (its attention runs over several query positions at once); relative
# and absolute, as torch.allclose.
TOLERANCE = 1e-5


def test_rows_with_bias_penalties_or_logprobs_may_draft() -> None:
    for changed in ({"logprobs": 0}, {"logprobs": 3, "logprobs_mode": "processed"},
                    {"logprobs": 0, "logprob_token_ids": [4, 5]}, {"logit_bias": {3: 1.0}},
                    {"presence_penalty": 0.5}, {"frequency_penalty": 0.2},
                    {"repetition_penalty": 1.1, "penalty_last_n": 16}):
        assert may_draft(greedy(**changed)), changed
    # Prompt scoring reads the logits of prompt positions: it does not draft.
    assert not may_draft(greedy(prompt_logprobs=0))


def test_draft_contexts_hold_each_chunks_drafts_up_to_the_row() -> None:
    a = Sequence("a", [1], greedy())
    b = Sequence("b", [2], greedy())
    assert draft_contexts([a, a, a, b, b], [7, 8, 9, 3, 4]) == [
        [7], [7, 8], [7, 8, 9], [3], [3, 4]]


# ---- draft positions against plain decoding -----------------------------------------


def _random_params(rng: random.Random) -> p.SamplingParams:
    kind = dict(rng.choice(KINDS))
    if rng.random() < 0.5:
        kind["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-3, 3) for _ in range(3)}
    count = rng.choice([-1, 0, 3])
    if count >= 0:
        kind["logprobs"] = count
        kind["logprobs_mode"] = rng.choice(["raw", "processed"])
        if rng.random() < 0.5:
            kind["logprob_token_ids"] = [rng.randrange(VOCAB) for _ in range(2)]
    if rng.random() < 0.5:
        kind.update(temperature=0.9, top_k=12, top_p=0.9)
    else:
        kind["temperature"] = 0.0
    return p.SamplingParams(max_tokens=1000, **kind)  # type: ignore[arg-type]


def _plain(seq: Sequence, draft: list[int], logits: torch.Tensor, target: int, sparse: bool
           ) -> tuple[torch.Tensor, p.TokenLogprobs | None]:
    """What plain decoding does at seq's context plus draft: the logits as
    the sampler leaves them, and the log probabilities of target there."""
    context = Sequence(f"{seq.request_id}+{len(draft)}", seq.token_ids[: seq.num_prompt_tokens],
                       seq.params)
    context.token_ids.extend(seq.token_ids[seq.num_prompt_tokens :] + draft)
    context.status = SeqStatus.RUNNING
    sampler = Sampler(CPU)
    sampler.penalties = PenaltyState(CPU, sparse=sparse)
    logits = logits.clone().unsqueeze(0)
    raw = RowLogprobs.of(logits, [context])
    sampler.sample(logits, [context])
    use_processed(raw, logits, [context], sampler)
    entry = raw.to_host(torch.tensor([target])).per_row(1)[0] if raw is not None else None
    return logits[0], entry


def _assert_same_logprobs(got: p.TokenLogprobs | None, want: p.TokenLogprobs | None) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None
    assert math.isclose(got.logprob, want.logprob, rel_tol=TOLERANCE, abs_tol=TOLERANCE) or \
        got.logprob == want.logprob == -math.inf
    # Alternatives cut to -inf (processed mode) tie: their order is arbitrary.
    finite = [i for i, value in enumerate(want.top_logprobs) if value > -math.inf]
    assert [got.top_ids[i] for i in finite] == [want.top_ids[i] for i in finite]
    assert torch.allclose(torch.tensor(got.top_logprobs), torch.tensor(want.top_logprobs),
                          rtol=TOLERANCE, atol=TOLERANCE)
    assert torch.allclose(torch.tensor(got.named_logprobs), torch.tensor(want.named_logprobs),
                          rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("seed", range(3))
def test_draft_positions_see_what_plain_decoding_would(seed: int, sparse: bool) -> None:
    """Verify steps over a batch of every kind of row: at each draft position
    the logits are biased and penalised, and the log probabilities reported,
    exactly as plain decoding's at that context; after each step a row keeps
    its sampled token and some of the targets, and the next step's penalty
    counts (the lanes caught up) must count exactly those."""
    rng = random.Random(seed)
    spec = Sampler(CPU, seed=3)
    spec.penalties = PenaltyState(CPU, sparse=sparse)
    seqs = []
    for i in range(8):
        seq = Sequence(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))],
                       _random_params(rng))
        seq.status = SeqStatus.RUNNING
        seqs.append(seq)
    logits_of = torch.Generator().manual_seed(seed)
    kept = 0
    for _ in range(6):
        drafts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 5))] for _ in seqs]
        rows = [seq for seq, draft in zip(seqs, drafts, strict=True) for _ in draft]
        drafted = [token for draft in drafts for token in draft]
        raw_logits = torch.randn(len(rows), VOCAB, generator=logits_of) * 3
        logits = raw_logits.clone()
        raw = RowLogprobs.of(logits, rows)
        positions = [seq.num_output_tokens + 1 + i for draft, seq in zip(drafts, seqs, strict=True)
                     for i in range(len(draft))]
        targets = spec.draw_targets(logits, rows, positions, ahead=draft_contexts(rows, drafted),
                                    resolve=None)
        asked = DraftLogprobs()
        asked.take(raw, logits, rows, targets, spec)
        entries = asked.per_row(len(rows))
        row = 0
        for seq, draft in zip(seqs, drafts, strict=True):
            for i in range(len(draft)):
                want_logits, want_entry = _plain(seq, draft[: i + 1], raw_logits[row],
                                                 int(targets[row]), sparse)
                assert torch.equal(logits[row], want_logits), (seq.params, i)
                _assert_same_logprobs(entries[row], want_entry)
                row += 1
        # The verify chunk's first position, then what each row keeps.
        firsts = spec.sample(torch.randn(len(seqs), VOCAB, generator=logits_of), seqs)
        row = 0
        for seq, draft, first in zip(seqs, drafts, firsts, strict=True):
            accepted = rng.randrange(len(draft) + 1)
            seq.token_ids.extend([first, *targets[row : row + accepted].tolist()])
            kept += accepted
            row += len(draft)
    assert kept > 20
    # Each lane, brought up to date, holds what a lane filled afresh would.
    fresh = PenaltyState(CPU, sparse=sparse)
    for seq in seqs:
        if not seq.params.has_penalties:
            continue
        with torch.inference_mode():  # as the sampler calls it
            for state in (spec.penalties, fresh):
                state.apply(torch.zeros(1, VOCAB), [seq])
        got = spec.penalties.counts[spec.penalties._lanes[seq.request_id].index]
        want = fresh.counts[fresh._lanes[seq.request_id].index]
        assert torch.equal(got, want), seq.params


# ---- whole engines -------------------------------------------------------------------

# A row of each kind; the passage's copy is still their answer, so drafts are
# accepted. (A repetition penalty over the whole context, prompt included,
# steers the model off the copy: it is tried with a window.)
FEATURES: dict[str, dict[str, object]] = {
    "bias": {"logit_bias": {13: 2.0, 260: -3.0}},
    "top": {"logprobs": 5, "logprob_token_ids": [13, 260]},
    "processed": {"logprobs": 4, "logprobs_mode": "processed", "repetition_penalty": 2.0,
                  "penalty_last_n": 16, "logit_bias": {13: 1.5}},
    "frequency": {"presence_penalty": 0.3, "frequency_penalty": 0.2},
    # Strong enough that leaving the draft tokens out of the counts (or a
    # window's leaving tokens in) changes the tokens.
    "window": {"repetition_penalty": 1.5, "penalty_last_n": 4, "logprobs": 2},
}

Outputs = dict[str, tuple[list[int], list[p.TokenLogprobs], int]]


def outputs_of(core: EngineCore, events: list[p.EngineEvent],
               requests: dict[str, tuple[list[int], p.SamplingParams]]) -> Outputs:
    """Per request: its tokens, their log probabilities, its drafts accepted."""
    found: Outputs = {name: ([], [], 0) for name in requests}
    for event in run_to_completion(core, events, requests):
        assert isinstance(event, p.StepOutputs), event
        for output in event.outputs:
            tokens, logprobs, accepted = found[output.request_id]
            found[output.request_id] = (tokens + output.token_ids, logprobs + output.logprobs,
                                        accepted + output.num_draft_accepted)
    return found


def assert_unchanged(got: Outputs, want: Outputs,
                     requests: dict[str, tuple[list[int], p.SamplingParams]],
                     drafting: list[str]) -> None:
    """The same tokens and log probabilities; the rows in drafting had drafts accepted."""
    for name, (_, params) in requests.items():
        tokens, logprobs, accepted = got[name]
        assert tokens == want[name][0], name
        assert len(logprobs) == len(want[name][1]) == (
            len(tokens) if params.logprobs >= 0 else 0), name
        for entry, expected in zip(logprobs, want[name][1], strict=True):
            _assert_same_logprobs(entry, expected)
        assert accepted > 0 or name not in drafting, f"{name}: no draft accepted"


@pytest.fixture(scope="module")
def copy_prompt(smollm2_gguf: Path) -> list[int]:
    return chat_prompt(smollm2_gguf, COPY)


def test_a_mixed_batch_is_unchanged_by_speculation(smollm2_gguf: Path,
                                                   copy_prompt: list[int]) -> None:
    """Every feature's row beside the others (each must have drafts accepted):
    what each alone would show, in one run of the CPU's slowest model."""
    batch = {name: (copy_prompt, greedy(40, **feature)) for name, feature in FEATURES.items()}
    batch["plain"] = (copy_prompt, greedy(40))
    batch["short"] = (copy_prompt[:30], greedy(12, presence_penalty=0.5, logprobs=1))
    batch["sampled"] = (copy_prompt, p.SamplingParams(max_tokens=20, temperature=0.8, seed=5,
                                                      frequency_penalty=0.2, logprobs=1))
    plain_core, plain_events = engine(smollm2_gguf)
    core, events = engine(smollm2_gguf, **SPEC)
    got, want = outputs_of(core, events, batch), outputs_of(plain_core, plain_events, batch)
    # On the CPU a sampled row's draws come in another order: only its length holds.
    sampled = batch.pop("sampled")
    assert len(got["sampled"][0]) == len(got["sampled"][1]) == sampled[1].max_tokens
    assert_unchanged(got, want, batch, [*FEATURES, "plain"])
    assert_no_pages_held(core)


def test_penalties_and_logprobs_survive_preemption_under_speculation(
        smollm2_gguf: Path, copy_prompt: list[int]) -> None:
    """Three copies share a KV pool too small for them: rows are preempted and
    recomputed mid-answer, their penalty lanes brought up to date after."""
    small = {"kv_capacity_tokens": 160, "output_window": 0, "max_context": 160,
             "max_concurrency": 3}
    kinds = ["frequency", "window", "processed"]
    batch = {name: (copy_prompt, greedy(48, **FEATURES[name])) for name in kinds}
    plain_core, plain_events = engine(smollm2_gguf, **small)
    core, events = engine(smollm2_gguf, **small, **SPEC)
    got = outputs_of(core, events, batch)
    assert core.scheduler.num_preemptions > 0
    assert_unchanged(got, outputs_of(plain_core, plain_events, batch), batch, kinds)
    assert_no_pages_held(core)
