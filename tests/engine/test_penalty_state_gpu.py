"""Penalties kept on the device (engine/sampling/penalty_state.py) on CUDA,
through the kernel sampler, against the per-row reference computed on the
CPU (tests/engine/penalty_reference.py) at every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.execution.future_tokens import FutureTokens
from engine.scheduling.sequence import SeqStatus, Sequence
from tests.engine import in_process
from tests.engine.penalty_reference import CheckedSampler
from tests.engine.test_penalty_state import KINDS, engine_requests, run_engine

pytestmark = pytest.mark.gpu

VOCAB = 151_936  # Qwen3's: flat positions lane * vocab + id well past 2^31 / 5
# Division, multiplication and subtraction round the same on both sides.
TOLERANCE = 1e-6


def new_seq(rng: random.Random, request_id: str) -> Sequence:
    sampled = {"temperature": 0.9, "top_k": 50, "seed": rng.randrange(1000)}
    params = p.SamplingParams(max_tokens=rng.randrange(8, 40), **rng.choice(KINDS),  # type: ignore[arg-type]
                              **(sampled if rng.random() < 0.5 else {"temperature": 0.0}))
    # Few distinct ids, so tokens repeat.
    seq = Sequence(request_id, [rng.randrange(50) for _ in range(rng.randrange(1, 40))], params)
    seq.status = SeqStatus.RUNNING
    return seq


def test_the_kernel_path_penalises_as_the_cpu_reference() -> None:
    rng = random.Random(0)
    device = torch.device("cuda")
    lanes = 16
    sampler = CheckedSampler(device, seed=3, use_kernel=True, tolerance=TOLERANCE)
    future = FutureTokens(lanes, device)
    seqs = [new_seq(rng, f"r{i}") for i in range(2 * lanes)]
    pending: list[tuple[Sequence, int]] = []
    previous: list[int] = []
    generator = torch.Generator(device=device).manual_seed(1)
    for _ in range(80):
        batch = [s for s in seqs if s.status is SeqStatus.RUNNING and rng.random() < 0.7][:lanes]
        logits = torch.randn(len(batch), VOCAB, device=device, generator=generator) * 3
        # Make the sampled tokens likely to repeat: a few ids stand out.
        logits[:, :50] += 4
        tokens = sampler.sample_on_device(logits, batch, resolve=future.resolve)
        greedy = [row for row, seq in enumerate(batch) if seq.params.greedy]
        assert tokens[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()
        first = future.next_slots()
        future.write(first, tokens)
        for (seq, index), token in zip(pending, previous, strict=True):
            seq.token_ids[index] = token
        pending = [(seq, seq.num_tokens) for seq in batch]
        previous = tokens.tolist()
        for row, seq in enumerate(batch):
            seq.token_ids.append(-(first + row + 1))
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens >= seq.params.max_tokens and seq not in batch:
                # (Not in this step: its tokens are all on the host.)
                sampler.forget(seq.request_id)
                seqs[i] = new_seq(rng, f"{seq.request_id}+")
            elif seq not in batch and rng.random() < 0.1:
                seq.status = (SeqStatus.WAITING if seq.status is SeqStatus.RUNNING
                              else SeqStatus.RUNNING)
    assert sampler.rows_ahead > 500, (sampler.rows_ahead, sampler.rows)


def test_the_engine_on_the_gpu_penalises_as_the_cpu_reference(tiny_qwen3_dir: Path) -> None:
    # 8 pages of 16 tokens for 4 lanes of up to 53 tokens: decoding preempts.
    core, events = in_process.make_engine(tiny_qwen3_dir, device="cuda", dtype="bfloat16",
                                          page_size=16, max_concurrency=4,
                                          max_batched_tokens=256, kv_capacity_tokens=128,
                                          output_window=0, max_context=96)
    # The engine's own choice: the tiny model's head size (16) keeps our
    # kernels off, so this is the torch path on CUDA (the test above takes
    # the sampling kernel's).
    checked = CheckedSampler(torch.device("cuda"), use_kernel=core.sampler.use_kernel,
                             tolerance=TOLERANCE)
    core.sampler = core.runner.sampler = checked
    requests = engine_requests(random.Random(0), penalties=True)
    got = run_engine(core, events, requests)
    assert all(len(tokens) == 24 for tokens in got.values()), got
    assert core.scheduler.num_preemptions > 0
    assert checked.rows_ahead > checked.rows // 2 > 50, (checked.rows_ahead, checked.rows)
    assert checked.penalties.counts is None
