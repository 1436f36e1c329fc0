"""Reuse to the token (engine/kv/partial_pages.py) on CUDA, with our kernels
and CUDA graphs (decode and prompt chunks): the copied token slots hold the
source page's very bytes, the source page is never written, and the tokens
are those computed from scratch (tests/engine/test_partial_pages.py on CUDA).

From scratch means here: the same prompt with cache_prompt false, in the same
engine. cuBLAS rounds a row differently for another number of rows in a step
(tests/engine/test_gpu_engine.py), so equal tokens are only guaranteed where
the from-scratch run computes the same chunks: the first test lines its
chunks up with the reusing run's and asks for equal tokens and equal K/V
bytes; the others, where a cached page holds tokens that decode steps wrote,
ask for equal tokens up to bf16 closeness (where they part, the reusing
run's token is among the from-scratch run's 5 most likely).
Run on the lent GPU: pytest -m gpu this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import protocol as p
from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.partial_pages import partial_hash
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import step_outputs
from tests.engine.test_host_kv_tier_gpu import PAGE, prompt, qwen3_bf16

pytestmark = pytest.mark.gpu
__all__ = ["qwen3_bf16"]  # the module's fixture, shared

# A step computes at most 24 tokens: a 24-token prompt is one chunk, and a
# 40-token one is [0, 24) then [24, 40), both padded to captured chunk graphs.
STEP_TOKENS = 24
TOP_K_CLOSE = 5


def make_engine(model: Path) -> tuple[EngineCore, list[p.EngineEvent]]:
    core, events = in_process.make_engine(
        model, device="cuda", dtype="bfloat16", page_size=PAGE, max_concurrency=4,
        max_batched_tokens=STEP_TOKENS, kv_capacity_tokens=2048, output_window=16)
    runner = core.runner
    assert runner.graphs is not None and runner.graphs.captured, "CUDA graphs must be on"
    assert runner.chunk_graphs is not None
    return core, events


def greedy(max_tokens: int = 16, **fields: object) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            **fields)  # type: ignore[arg-type]


@dataclass
class Run:
    tokens: list[int]
    cached: int
    hits: p.CacheHits | None
    # The device pages the request held (as admitted; growth appended).
    pages: list[int]
    # Per generated token, the 5 most likely tokens (when logprobs were asked).
    top: list[list[int]]


def run_all(core: EngineCore, events: list[p.EngineEvent],
            requests: dict[str, tuple[list[int], p.SamplingParams]]) -> dict[str, Run]:
    """Run the requests together, noting each one's pages while it runs."""
    events.clear()
    for request_id, (tokens, params) in requests.items():
        core.handle(p.Generate(request_id, tokens, params))
    pages: dict[str, list[int]] = {}
    while core.has_work:
        core.step()
        core.scheduler.check_invariants()
        for seq in core.scheduler.running:
            if seq.request_id in requests:
                pages[seq.request_id] = list(seq.block_table)
    outputs = step_outputs(events)
    runs = {}
    for request_id in requests:
        mine = [o for o in outputs if o.request_id == request_id]
        assert mine and mine[-1].finish_reason is not None, events
        hits = [o.cache_hits for o in mine if o.cache_hits is not None]
        runs[request_id] = Run([t for o in mine for t in o.token_ids], mine[-1].num_cached_tokens,
                               hits[0] if hits else None, pages[request_id],
                               [lp.top_ids for o in mine for lp in o.logprobs])
    return runs


def run(core: EngineCore, events: list[p.EngineEvent], request_id: str, tokens: list[int],
        params: p.SamplingParams | None = None) -> Run:
    return run_all(core, events, {request_id: (tokens, params or greedy())})[request_id]


def scratch(core: EngineCore, events: list[p.EngineEvent], tokens: list[int],
            top: bool = True) -> Run:
    """tokens computed from the first, in this engine; with top, the 5 most
    likely tokens at each generated one too (the exact comparison asks for
    none: the sampler then takes the very path of the run compared)."""
    params = greedy(cache_prompt=False, logprobs=TOP_K_CLOSE if top else -1)
    return run(core, events, "scratch", tokens, params)


def page_kv(core: EngineCore, page: int, num_tokens: int = PAGE) -> list[torch.Tensor]:
    """The K/V of a page's first num_tokens token slots, every layer and side."""
    return [cache[page, :num_tokens].clone() for caches in core.runner.kv_caches
            for cache in caches]


def assert_same_kv(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"layer {index // 2} {'kv'[index % 2]} differs"


def assert_close(ours: Run, reference: Run) -> None:
    """Equal greedy tokens up to bf16 closeness (see the module docstring)."""
    assert len(ours.tokens) == len(reference.tokens)
    diverged = next((i for i, (a, b) in enumerate(zip(ours.tokens, reference.tokens,
                                                      strict=True)) if a != b), None)
    if diverged is not None:
        top = reference.top[diverged]
        assert ours.tokens[diverged] in top, (
            f"token {diverged}: {ours.tokens[diverged]} vs {reference.tokens[diverged]}; the "
            f"reference's top {TOP_K_CLOSE} are {top}")
        print(f"parted from scratch at token {diverged} of {len(ours.tokens)}, at a near-tie")


def source_page(core: EngineCore, parent: bytes, held: list[int]) -> int:
    kv = core.scheduler.kv
    page = kv.pool.lookup(partial_hash(parent, held, kv.fingerprint), held)
    assert page is not None, "the partial page was not kept"
    return page


def test_reuse_to_the_token_computes_what_the_same_chunks_compute_from_scratch(
        qwen3_bf16: Path) -> None:
    """A 24-token first turn leaves page 0 full and page 1 holding 8 tokens;
    a 40-token second turn reuses page 0 and, copied, those 8 tokens, and
    computes [24, 40) in one chunk: from scratch the same chunks run
    ([0, 24), then [24, 40)), so tokens and K/V are equal bit for bit."""
    core, events = make_engine(qwen3_bf16)
    conversation = prompt(1, 40)
    run(core, events, "turn-1", conversation[:24], greedy(1))
    kv = core.scheduler.kv
    parent = hash_page(ROOT_HASH, conversation[:PAGE], kv.fingerprint)
    source = source_page(core, parent, conversation[PAGE:24])
    source_before = page_kv(core, source)

    reused = run(core, events, "turn-2", conversation)
    assert reused.hits == p.CacheHits(device=PAGE, partial=8) and reused.cached == 24
    assert reused.pages[1] != source
    # The copy: the fresh page's first 8 slots are the source's.
    assert_same_kv(page_kv(core, reused.pages[1], 8), [t[:8] for t in source_before])
    reused_kv = [page_kv(core, page) for page in reused.pages[1:3]]

    computed = scratch(core, events, conversation, top=False)
    assert computed.cached == 0
    assert reused.tokens == computed.tokens
    for got, expected in zip(reused_kv, (page_kv(core, page) for page in computed.pages[1:3]),
                             strict=True):
        assert_same_kv(got, expected)
    # Copy on write: the cached page was never written, and is still the entry.
    assert source_page(core, parent, conversation[PAGE:24]) == source
    assert_same_kv(page_kv(core, source), source_before)


def test_a_second_turn_reuses_its_first_turns_partial_page_without_writing_it(
        qwen3_bf16: Path) -> None:
    """Page 1 of the first turn holds 4 prompt tokens and 4 that decode steps
    (graph replays) wrote; the second turn copies all 8."""
    core, events = make_engine(qwen3_bf16)
    turn = prompt(3, 20)
    first = run(core, events, "turn-1", turn, greedy(5))
    # 24 tokens computed: page 0 full, page 1 holds 8 (4 prompt + 4 output).
    kv = core.scheduler.kv
    parent = hash_page(ROOT_HASH, turn[:PAGE], kv.fingerprint)
    held = (turn + first.tokens)[PAGE:24]
    source = source_page(core, parent, held)
    before = page_kv(core, source)

    second = turn + first.tokens + prompt(4, 6)
    got = run(core, events, "turn-2", second)
    assert got.cached == 24 and got.hits == p.CacheHits(device=16, partial=8)
    assert_same_kv(page_kv(core, got.pages[1], 8), [t[:8] for t in before])
    assert_close(got, scratch(core, events, second))
    assert source_page(core, parent, held) == source
    assert_same_kv(page_kv(core, source), before)


def test_a_batch_copies_one_cached_partial_page_into_each_of_its_pages(
        qwen3_bf16: Path) -> None:
    """Three prompts admitted in one step copy the same 8 token slots, each
    into its own page, while their steps replay graphs together."""
    core, events = make_engine(qwen3_bf16)
    base = prompt(5, 10)
    seed = run(core, events, "seed", base, greedy(2))
    # 11 tokens computed: page 0 holds them, kept as a partial page.
    source = source_page(core, ROOT_HASH, (base + seed.tokens)[:11])
    before = page_kv(core, source)
    kv = core.scheduler.kv
    batch = {f"r{i}": (base[:8] + prompt(10 + i, 4 + i), greedy()) for i in range(3)}
    results = run_all(core, events, batch)
    assert kv.partial.hits == 3
    targets = {results[name].pages[0] for name in batch}
    assert len(targets) == 3 and source not in targets
    for name, (tokens, _) in batch.items():
        assert results[name].hits == p.CacheHits(partial=8), name
        assert_same_kv(page_kv(core, results[name].pages[0], 8), [t[:8] for t in before])
        assert_close(results[name], scratch(core, events, tokens))
    assert_same_kv(page_kv(core, source), before)
