"""Helpers of the batch-invariance tests (--deterministic), CPU and GPU: run
requests through an in-process engine and keep, per request, its tokens and
the logits each of its tokens was drawn from, to compare bit for bit."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import protocol as p
from engine.scheduling.core import EngineCore
from tests.engine.in_process import run_to_completion, step_outputs

Requests = Mapping[str, tuple[list[int], p.SamplingParams]]


@dataclass
class Outcome:
    """One request's run: its tokens, the float32 logits row of each (as the
    model gave them, before sampling), and its prompt tokens served from the
    prefix cache."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    cached_tokens: int = 0

    def same_bits(self, other: Outcome) -> bool:
        return (self.tokens == other.tokens and len(self.logits) == len(other.logits)
                and all(torch.equal(a, b) for a, b in zip(self.logits, other.logits, strict=True)))


def record_logits(core: EngineCore) -> dict[str, list[torch.Tensor]]:
    """Wraps the runner's forward() so that each step's sampled logits rows
    are copied to the host, by request, before the sampler sees them."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)
    forward = core.runner.forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        step = forward(*args, **kwargs)
        if step.logits is not None:
            rows = step.logits.float().cpu()
            for row, seq in zip(rows, step.inputs.sample_seqs, strict=True):
                seen[seq.request_id].append(row.clone())
        return step

    core.runner.forward = recording  # type: ignore[method-assign]
    return seen


def run_recorded(core: EngineCore, events: list[p.EngineEvent],
                 requests: Requests) -> dict[str, Outcome]:
    """Runs the requests to completion (all submitted at once); each
    request's outcome, its logits cut to its max_tokens rows."""
    seen = record_logits(core)
    outcomes = {request_id: Outcome() for request_id in requests}
    for output in step_outputs(run_to_completion(core, events, requests)):
        outcome = outcomes[output.request_id]
        outcome.tokens.extend(output.token_ids)
        outcome.cached_tokens = max(outcome.cached_tokens, output.num_cached_tokens)
    for request_id, (_, params) in requests.items():
        outcomes[request_id].logits = seen.get(request_id, [])[: params.max_tokens]
    del core.runner.forward  # the class's own again
    return outcomes


def prompt(first: int, length: int) -> list[int]:
    """A prompt of distinct ordinary token ids."""
    return [first + 3 * i for i in range(length)]


class RecordedDrafter:
    """Drafts each request's continuation from a recorded run, every third
    guess wrong, so that verify steps keep some drafts and reject others."""

    def __init__(self, recorded: dict[tuple[int, ...], list[int]]) -> None:
        self.recorded = recorded

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        for prompt_ids, output in self.recorded.items():
            if tuple(token_ids[: len(prompt_ids)]) == prompt_ids:
                done = len(token_ids) - len(prompt_ids)
                draft = output[done : done + max_tokens]
                return [token + 1 if (done + i) % 3 == 2 else token
                        for i, token in enumerate(draft)]
        return []
