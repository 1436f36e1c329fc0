"""Tensor-parallel ranks as real processes on the CPU (gloo), for the tests.

run_ranks spawns world_size processes that meet through a file rendezvous in
a temporary directory (no port to race for), each loads every subject's
checkpoint as its rank's share and runs the same generation through the paged
KV cache as the engine lays it out: the prompt prefilled in chunks, then
greedy decode steps, one token each. Rank 0 writes the logits of every step,
every rank its tokens. The processes are bounded by a deadline and killed if
they outlive it or one of them fails.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

from engine.loader import load_model
from engine.models import CausalLM
from engine.parallel.tensor_parallel import join_tensor_parallel, leave_tensor_parallel
from tests.engine.test_model_exactness import PagedRunner

CPU = torch.device("cpu")
CHUNK = 7  # prompt chunk, as the scheduler cuts long prompts (pages hold 16)
DECODE_STEPS = 8


@dataclass(frozen=True)
class Subject:
    name: str
    path: Path
    prompt: tuple[int, ...]


@dataclass
class Trace:
    """One generation: each step's logits [rows, vocab] and the greedy tokens."""

    logits: list[torch.Tensor]
    tokens: list[int]


def generate(model: CausalLM, prompt: tuple[int, ...]) -> Trace:
    runner = PagedRunner(model)
    logits = [runner.logits([(0, list(prompt[i:i + CHUNK]))])
              for i in range(0, len(prompt), CHUNK)]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(DECODE_STEPS):
        logits.append(runner.logits([(0, tokens[-1:])]))
        tokens.append(int(logits[-1][-1].argmax()))
    return Trace(logits, tokens)


def _rank_main(rank: int, world_size: int, directory: str, subjects: list[Subject]) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    tp = join_tensor_parallel(f"file://{directory}/rendezvous", rank, world_size, CPU,
                              timeout=timedelta(seconds=60))
    try:
        traces = {subject.name: generate(load_model(subject.path, CPU, torch.float32,
                                                    tp=tp).model, subject.prompt)
                  for subject in subjects}
    finally:
        leave_tensor_parallel(tp)
    if rank:  # the logits are gathered: rank 0's are every rank's
        traces = {name: Trace([], trace.tokens) for name, trace in traces.items()}
    torch.save(traces, Path(directory) / f"rank{rank}.pt")


def run_ranks(world_size: int, subjects: list[Subject], directory: Path,
              deadline_s: float = 120.0) -> list[dict[str, Trace]]:
    """Each rank's traces by subject name, rank 0 first."""
    context = mp.start_processes(_rank_main, args=(world_size, str(directory), subjects),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        # join raises the first failing rank's traceback, having ended the others.
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} tensor-parallel ranks ran past "
                                   f"{deadline_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False)
            for rank in range(world_size)]
