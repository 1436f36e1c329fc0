"""Penalties kept on the device (engine/sampling/penalty_state.py) against the
per-row host implementation they replaced (tests/engine/penalty_reference.py):
the same penalised logits bit for bit, so the same greedy and seeded tokens,
in batches that mix every kind of penalty row with plain rows, with tokens
still on the device, preemptions, evicted lanes and request ids used again;
then the whole engine on the small random Qwen3."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution.future_tokens import FutureTokens
from engine.sampling.penalty_state import LANE_STEP, PenaltyState, penalty_state_bytes
from engine.sampling.sampler import Sampler
from engine.scheduling.core import EngineCore
from engine.scheduling.sequence import SeqStatus, Sequence
from tests.engine import in_process
from tests.engine.in_process import SMALL_STEPS, run_to_completion
from tests.engine.penalty_reference import CheckedSampler, HostPenaltySampler

VOCAB = 40
# Every way the penalties read the tokens, and a plain row.
KINDS: list[dict[str, object]] = [
    {"repetition_penalty": 1.3},  # the whole context, prompt included
    {"presence_penalty": 0.5, "frequency_penalty": 0.3},  # generated tokens only
    {"repetition_penalty": 1.5, "presence_penalty": 0.4, "penalty_last_n": 3},
    {"frequency_penalty": 0.7, "penalty_last_n": 1},  # the token leaving is the pending one
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "presence_penalty": -0.3,
     "penalty_last_n": 8},
    {"repetition_penalty": 1.2, "presence_penalty": 0.2, "penalty_last_n": 1 << 30},
    {"repetition_penalty": 1.1, "presence_penalty": 0.6, "frequency_penalty": 0.2},
    {},
]


class Pipeline:
    """Two samplers fed the same logits and the same sequences, whose tokens
    reach the host one step late, as in the engine (engine/scheduling/core.py):
    placeholders into a FutureTokens buffer until then."""

    def __init__(self, rng: random.Random, lanes: int, sparse: bool) -> None:
        self.rng = rng
        self.future = FutureTokens(lanes, torch.device("cpu"))
        self.device_side = Sampler(torch.device("cpu"), seed=5)
        self.device_side.penalties = PenaltyState(torch.device("cpu"), sparse=sparse)
        self.host_side = HostPenaltySampler(torch.device("cpu"), seed=5)
        self.pending: list[tuple[Sequence, int]] = []  # (seq, index of its placeholder)
        self.logits = torch.Generator().manual_seed(rng.randrange(1 << 30))
        self.pending_penalty_rows = 0

    def new_seq(self, request_id: str) -> Sequence:
        kind = self.rng.choice(KINDS)
        sampled = {"temperature": 0.9, "top_k": 12, "seed": self.rng.randrange(1000)}
        params = p.SamplingParams(max_tokens=self.rng.randrange(4, 30), **kind,  # type: ignore[arg-type]
                                  **(sampled if self.rng.random() < 0.5 else {"temperature": 0.0}))
        # Few distinct ids, so tokens repeat and every penalty bites.
        prompt = [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(1, 20))]
        seq = Sequence(request_id, prompt, params)
        seq.status = SeqStatus.RUNNING
        return seq

    def step(self, batch: list[Sequence]) -> None:
        logits = torch.randn(len(batch), VOCAB, generator=self.logits) * 2
        mine, theirs = logits.clone(), logits.clone()
        self.pending_penalty_rows += sum(1 for s in batch
                                         if s.params.has_penalties and s.has_pending_token)
        want = self.host_side.sample(theirs, batch, resolve=self.future.resolve)
        got = self.device_side.sample(mine, batch, resolve=self.future.resolve)
        assert torch.equal(mine, theirs), (mine - theirs).abs().max()
        assert got == want
        first = self.future.next_slots()
        self.future.write(first, torch.tensor(got, dtype=torch.int64))
        # The step before completes only now: its tokens replace their placeholders.
        for seq, index in self.pending:
            seq.token_ids[index] = int(self.future.buffer[-seq.token_ids[index] - 1])
        self.pending = []
        for row, seq in enumerate(batch):
            self.pending.append((seq, seq.num_tokens))
            seq.token_ids.append(-(first + row + 1))

    def forget(self, request_id: str) -> None:
        self.device_side.forget(request_id)
        self.host_side.forget(request_id)


# The sparse way is the CPU's; the dense one the GPU's, checked here for exactness too.
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("seed", range(3))
def test_device_penalties_equal_the_host_ones_step_after_step(seed: int, sparse: bool) -> None:
    rng = random.Random(seed)
    lanes = 8  # rows a step samples at most
    pipeline = Pipeline(rng, lanes, sparse)
    state = pipeline.device_side.penalties
    calls = {"_fill": 0, "_evict": 0, "_grow": 0}
    for name in calls:
        method = getattr(state, name)

        def counted(*args: object, _method=method, _name=name) -> object:
            result = _method(*args)
            calls[_name] += 1 if result is not False else 0
            return result

        setattr(state, name, counted)
    # More requests than a step samples, half of them preempted at a time.
    seqs = {f"r{i}": pipeline.new_seq(f"r{i}") for i in range(3 * lanes)}
    for _ in range(120):
        running = [s for s in seqs.values() if s.status is SeqStatus.RUNNING]
        batch = [s for s in running if rng.random() < 0.8][:lanes]
        rng.shuffle(batch)
        if batch:
            pipeline.step(batch)
        for request_id, seq in list(seqs.items()):
            if seq.num_output_tokens >= seq.params.max_tokens and not seq.has_pending_token:
                # Finished: a new request, under a new id or (without the
                # lane freed first) the same one.
                if rng.random() < 0.5:
                    pipeline.forget(request_id)
                    del seqs[request_id]
                    request_id = f"{request_id}+"
                seqs[request_id] = pipeline.new_seq(request_id)
            elif seq.status is SeqStatus.RUNNING and seq not in batch and rng.random() < 0.5:
                seq.status = SeqStatus.WAITING  # preempted: its lane may go to another
            elif seq.status is SeqStatus.WAITING and rng.random() < 0.3:
                seq.status = SeqStatus.RUNNING
    # Every path was taken: lanes filled again, evicted, grown, and penalty
    # rows sampled with their newest token still on the device.
    assert calls["_fill"] > 20 and calls["_evict"] > 0 and calls["_grow"] > 1, calls
    assert pipeline.pending_penalty_rows > 50
    assert state.num_lanes <= 3 * lanes


def test_a_finished_row_is_left_alone_and_the_last_free_drops_the_tensors() -> None:
    state = PenaltyState(torch.device("cpu"))
    params = p.SamplingParams(max_tokens=5, frequency_penalty=1.0)
    alive, done = Sequence("a", [1, 1, 2], params), Sequence("b", [1, 1, 2], params)
    alive.token_ids += [3, 3]
    done.token_ids += [3, 3]
    done.status = SeqStatus.FINISHED
    logits = torch.zeros(2, 8)
    applied = state.apply(logits, [alive, done])
    assert applied is not None
    assert logits[0].tolist() == [0, 0, 0, -2, 0, 0, 0, 0] and not logits[1].any()
    applied.record(torch.tensor([4, 4]))
    assert state.counts is not None and state.counts[:, 4].sum() == 1
    assert state.num_lanes == LANE_STEP
    state.free("b")  # never held a lane
    assert state.counts is not None
    state.free("a")
    assert state.counts is None and state.in_prompt is None


def test_a_lane_that_no_longer_matches_its_sequence_is_filled_again() -> None:
    # Sampled twice with no token appended in between (as a caller that
    # drops the first draw would): the second sees the same tokens as the first.
    sampler = Sampler(torch.device("cpu"))
    seq = Sequence("a", [1, 2, 2], p.SamplingParams(max_tokens=5, temperature=0.0,
                                                    repetition_penalty=2.0, penalty_last_n=2))
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    first, second = logits.clone(), logits.clone()
    assert sampler.sample(first, [seq]) == [3]
    assert sampler.sample(second, [seq]) == [3]
    assert torch.equal(first, second) and first.tolist() == [[0.0, 1.0, 1.5, 2.0]]


def test_a_placeholder_needs_a_way_to_read_it() -> None:
    state = PenaltyState(torch.device("cpu"))
    seq = Sequence("a", [1, 2], p.SamplingParams(max_tokens=5, presence_penalty=1.0))
    seq.token_ids.append(-3)
    with pytest.raises(RuntimeError, match="placeholder"):
        state.apply(torch.zeros(1, 8), [seq])


def test_the_memory_set_aside_covers_every_lane() -> None:
    assert penalty_state_bytes(64, 151_936) == 64 * 151_936 * 5
    assert penalty_state_bytes(3, 100) == LANE_STEP * 100 * 5


# ---- the whole engine ----------------------------------------------------------


def engine_requests(rng: random.Random, penalties: bool) -> dict[str, tuple[list[int], p.SamplingParams]]:
    """Penalty rows of every kind and plain rows, greedy and seeded; two share a prompt."""
    shared = [rng.randrange(1000, 1100) for _ in range(20)]
    requests = {}
    for i, kind in enumerate(KINDS):
        prompt = shared if i < 2 else [rng.randrange(1000, 1060) for _ in range(rng.randrange(3, 30))]
        sampled = {"temperature": 0.8, "top_k": 40, "seed": 100 + i} if i % 2 else {"temperature": 0.0}
        params = p.SamplingParams(max_tokens=24, ignore_eos=True, **sampled,  # type: ignore[arg-type]
                                  **(kind if penalties else {}))
        requests[f"r{i}"] = (prompt, params)
    return requests


def run_engine(core: EngineCore, events: list[p.EngineEvent],
               requests: dict[str, tuple[list[int], p.SamplingParams]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    for event in run_to_completion(core, events, requests):
        assert isinstance(event, p.StepOutputs), event
        for output in event.outputs:
            tokens[output.request_id].extend(output.token_ids)
    return tokens


def make_engine(model: Path) -> tuple[EngineCore, list[p.EngineEvent]]:
    # 13 pages of 8 tokens for 4 lanes of up to 53 tokens: decoding preempts.
    return in_process.make_engine(model, **{**SMALL_STEPS, "kv_capacity_tokens": 104,
                                            "output_window": 0, "max_context": 96})


def test_the_engine_gives_the_tokens_host_penalties_gave(tiny_qwen3_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    requests = engine_requests(rng, penalties=True)
    # The second round, in the other order, finds prompts of the first in the prefix cache.
    rounds = [requests, dict(reversed(requests.items()))]
    # The reference: penalties per row on the host, penalty rows sampled
    # only once the step before is on the host (as the engine did before).
    reference, ref_events = make_engine(tiny_qwen3_dir)
    reference.sampler = reference.runner.sampler = HostPenaltySampler(torch.device("cpu"))
    put_off = reference._needs_host_tokens
    monkeypatch.setattr(reference, "_needs_host_tokens",
                        lambda seq: put_off(seq) or seq.params.has_penalties)
    want = [run_engine(reference, ref_events, batch) for batch in rounds]

    core, events = make_engine(tiny_qwen3_dir)
    checked = CheckedSampler(torch.device("cpu"))
    core.sampler = core.runner.sampler = checked
    got = [run_engine(core, events, batch) for batch in rounds]
    assert got == want
    assert core.scheduler.num_preemptions > 0 and core.scheduler.num_cached_tokens_total > 0
    # Penalty rows were sampled before the step before reached the host.
    assert checked.rows_ahead > checked.rows // 2 > 50, (checked.rows_ahead, checked.rows)
    # The penalties did change the tokens.
    plain = run_engine(core, events, engine_requests(random.Random(0), penalties=False))
    changed = [rid for rid, (_, params) in requests.items()
               if params.has_penalties and plain[rid] != got[0][rid]]
    assert len(changed) >= 5, changed
    # Every request ended: every lane is free and the counts are gone.
    assert checked.penalties.counts is None
