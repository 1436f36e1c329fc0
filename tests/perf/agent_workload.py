"""The multi-turn agent workload of tests/perf/bench_gpu_kv_tiers.py, and
an in-process driver that times each request's first token.

Each conversation is a seeded run of random tokens; each turn's prompt is
the one before plus some tokens (standing in for the previous answer and the
next message or tool output; the generated answer is discarded, so every
engine driven sees the very same prompts). Agents take turns: a few
conversations are in flight at once, and a conversation's next turn is
submitted only after its answer, behind every other conversation waiting its
turn, so it returns after the rest of the working set went through the
engine: the device prefix cache's least recently used page is then always
the returning conversation's.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

import protocol as p
from engine.scheduling.core import EngineCore
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB


@dataclass(frozen=True)
class Sizes:
    shape: str
    conversations: int
    turns: int
    final_tokens: tuple[int, int]  # a conversation's prompt at its last turn
    turn_tokens: tuple[int, int]  # what each turn adds
    answer_tokens: int
    in_flight: int
    page_size: int
    max_batched_tokens: int
    returning_tokens: int  # the returning conversation's history
    returning_new_tokens: int  # and its new turn
    device_share: float = 0.25
    host_share: float = 1.0
    disk_host_share: float = 0.5
    disk_restore_ms: int = 300
    # A configuration submits no new turn after this many seconds (its
    # figures then cover the turns done, and say so).
    max_config_seconds: float = 120.0


class Workload:
    """Every conversation's tokens and its prompt length at each turn."""

    def __init__(self, sizes: Sizes, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.histories: list[list[int]] = []
        self.lengths: list[list[int]] = []
        for _ in range(sizes.conversations):
            final = int(rng.integers(sizes.final_tokens[0], sizes.final_tokens[1] + 1))
            added = rng.integers(sizes.turn_tokens[0], sizes.turn_tokens[1] + 1,
                                 size=sizes.turns - 1)
            first = final - int(added.sum())
            if first < sizes.page_size:
                raise ValueError("the turns add more than a conversation's final length")
            self.lengths.append([first, *(first + np.cumsum(added)).tolist()])
            self.histories.append(rng.integers(0, QWEN3_TEXT_VOCAB, final).tolist())
        self.answer_tokens = sizes.answer_tokens

    def prompt(self, conversation: int, turn: int) -> list[int]:
        return self.histories[conversation][: self.lengths[conversation][turn]]

    @property
    def working_set_tokens(self) -> int:
        return sum(len(h) + self.answer_tokens for h in self.histories)

    @property
    def prompt_tokens(self) -> int:
        return sum(sum(lengths) for lengths in self.lengths)


class Driver:
    """Steps an engine, timing each request's first token."""

    def __init__(self, core: EngineCore, events: list[p.EngineEvent],
                 sync: Callable[[], None]) -> None:
        self.core, self.events, self.sync = core, events, sync
        self.stats = p.EngineStats()
        self.submitted: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.hits: dict[str, p.CacheHits] = {}

    def submit(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.handle(p.Generate(request_id, prompt, params))
        self.submitted[request_id] = time.perf_counter()

    def step(self) -> list[str]:
        """One engine step; the requests it finished."""
        self.events.clear()
        self.core.step()
        now = time.perf_counter()
        finished = []
        for event in self.events:
            if isinstance(event, p.RequestError):
                raise RuntimeError(f"request {event.request_id} failed: {event.message}")
            if not isinstance(event, p.StepOutputs):
                continue
            self.stats = event.stats
            for output in event.outputs:
                rid = output.request_id
                if output.cache_hits is not None:
                    self.hits[rid] = output.cache_hits
                if output.token_ids and rid not in self.ttft:
                    self.ttft[rid] = now - self.submitted[rid]
                if output.finish_reason is not None:
                    finished.append(rid)
        return finished

    def alone(self, request_id: str, prompt: list[int], max_tokens: int = 1) -> float:
        """Run one request by itself; its time to first token."""
        self.sync()
        self.submit(request_id, prompt, max_tokens)
        while self.core.has_work:
            self.step()
        return self.ttft[request_id]


def counters(before: p.EngineStats, after: p.EngineStats) -> dict[str, float]:
    """What the engine did between two stats: the *_total counters' growth,
    and the tiers' gauges after."""
    old, new = msgspec.structs.asdict(before), msgspec.structs.asdict(after)
    out = {key: new[key] - old[key] for key in new if key.endswith("_total")}
    for key in ("host_kv_pages_total", "host_kv_pages_cached", "disk_kv_pages_cached",
                "disk_kv_bytes_cached", "kv_pages_total"):
        out[key] = new[key]
    return out


def run_workload(driver: Driver, workload: Workload, sizes: Sizes,
                 warm_seed: int) -> dict[str, Any]:
    """Every conversation's turns, agents taking turns (see the module's
    docstring), after a short request of its own (warm_seed) that the
    counters leave out."""
    driver.alone(f"warm{warm_seed}", np.random.default_rng(1000 + warm_seed).integers(
        0, QWEN3_TEXT_VOCAB, 4 * sizes.page_size + 1).tolist(), sizes.answer_tokens)
    before = driver.stats
    # The same order of turns in every configuration.
    rng = np.random.default_rng(0)
    ready = collections.deque(int(c) for c in rng.permutation(sizes.conversations))
    next_turn = [0] * sizes.conversations
    conversation_of: dict[str, tuple[int, int]] = {}
    in_flight = done = prompt_tokens = 0
    driver.sync()
    started = time.perf_counter()
    stop_at = started + sizes.max_config_seconds
    while True:
        while ready and in_flight < sizes.in_flight and time.perf_counter() < stop_at:
            conversation = ready.popleft()
            turn = next_turn[conversation]
            next_turn[conversation] += 1
            rid = f"c{conversation}t{turn}"
            conversation_of[rid] = (conversation, turn)
            prompt = workload.prompt(conversation, turn)
            driver.submit(rid, prompt, sizes.answer_tokens)
            prompt_tokens += len(prompt)
            in_flight += 1
        if not driver.core.has_work:
            break
        for rid in driver.step():
            conversation, _ = conversation_of[rid]
            in_flight -= 1
            done += 1
            if next_turn[conversation] < sizes.turns:
                ready.append(conversation)
    seconds = time.perf_counter() - started
    assert done == len(conversation_of), f"{done} of {len(conversation_of)} requests finished"
    ttfts = [driver.ttft[rid] for rid in conversation_of]
    returning = [driver.ttft[rid] for rid, (_, turn) in conversation_of.items() if turn > 0]
    stats = counters(before, driver.stats)
    if not stats["preemptions_total"]:
        # The tiers' counters add up: every prompt token computed or reused.
        assert stats["prefill_tokens_total"] + stats["cached_tokens_total"] == prompt_tokens, \
            stats
    return {"requests": done, "capped": done < sizes.conversations * sizes.turns,
            "prompt_tokens": prompt_tokens,
            "computed_tokens": stats["prefill_tokens_total"],
            "cached_tokens": stats["cached_tokens_total"],
            "ttft_mean_s": float(np.mean(ttfts)), "ttft_p95_s": float(np.percentile(ttfts, 95)),
            "ttft_returning_mean_s": float(np.mean(returning)) if returning else None,
            "total_s": seconds, "counters": stats}
