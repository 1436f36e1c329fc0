"""Speculative decoding's speed against its acceptance rate (issue 16's H200
benchmark), each configuration timed against plain decoding in the same run.

    python tests/perf/bench_gpu_speculation.py [--shapes qwen3-8b,qwen3-0.6b]
        [--batches 1,8,32] [--drafts 2,4,8] [--wrong 0,0.3,1] [--tokens 128]
        [--deterministic] [--smoke]

Random weights give no natural acceptance, so the drafter is controlled: a
plain greedy run records every request's tokens, then an oracle drafter
proposes that recorded continuation with each drafted token turned wrong at
a set rate (--wrong: 0 accepts every draft, 1 none). Each request is a
random 128-token prompt asking for --tokens greedy tokens (ignore_eos). One
engine per shape serves every configuration (the scheduler's drafter and
draft length are switched between runs), so each ratio compares the same
weights, graphs and pool. Reported per shape, batch, draft length and
wrong-rate: output tok/s, its ratio to plain decoding, the acceptance rate
(accepted / proposed) and accepted tokens per verify step; the tokens of
every run are checked equal to the plain run's (greedy speculation is exact;
in bf16 a verify step may round a near tie differently from a plain step,
so only --deterministic, the engine's batch-invariant mode, makes the
check strict: then every row must say "same as plain").

New rows start from the engine's acceptance over recent rows
(engine/sampling/draft_length.py, DraftAcceptance). So that configurations
do not leak into each other, the scheduler gets a fresh estimate at every
switch of drafter, as a fresh engine has; each adaptive configuration then
runs twice and both are timed: "cold" (its batch is the engine's first:
every row starts at the full K) and then the reported run, in the steady
state of an engine that has served this workload (rows start from what the
cold run left). Plain decoding too is timed after a run of the same prompts.

The draft costs each row weighs (engine/sampling/draft_cost.py, DraftCosts:
measured online from the engine's step times) are the hardware's, model's
and batch's, not the workload's: they are kept across configurations within
a shape (one engine), as a serving engine keeps them whatever its requests
do. Each row records them as they stood after its run ("costs": verify_cost
and step_cost in a row's share of a plain step, b and c in seconds per
draft token and per step without overlap, t_plain the plain step's seconds
at the current batch; "measured" false: still the constants).

Targets (issue 16): at 8B, batch 1, every draft accepted, K = 4: >= 3x plain;
at zero acceptance: at most 5% slower than plain (the adaptive switch-off).

--smoke runs it on the CPU at a tiny shape in seconds (tests/test_perf_smoke.py)
so the script cannot rot. Writes every figure to $OUT/bench_gpu_speculation.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import protocol as p
from engine.sampling.draft_length import DraftAcceptance
from engine.scheduling.core import EngineCore
from router.heap import freeze_long_lived
from tests.perf.gpu_models import make_engine, random_model

PROMPT_TOKENS = 128


class WrongAtRate:
    """Proposes a recorded run's continuation of the tokens it is shown, each
    drafted token replaced by another at the given rate (seeded)."""

    def __init__(self, runs: Sequence[list[int]], wrong: float, vocab: int, seed: int = 0) -> None:
        # Prompts are random: their first tokens tell the runs apart.
        self.runs = {tuple(run[:16]): run for run in runs}
        self.wrong = wrong
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        run = self.runs.get(tuple(token_ids[:16]))
        if run is None:
            return []
        start = len(token_ids)
        draft = []
        for token in run[start:start + max_tokens]:
            if self.rng.random() < self.wrong:
                token = (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            draft.append(token)
        self.proposed += len(draft)
        return draft


class FullLength:
    """A row that drafts its full length every step, whatever it keeps (the
    adaptive DraftLength's interface, engine/sampling/draft_length.py)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    def allows(self, num_output_tokens: int) -> bool:
        return True

    def limit(self, num_output_tokens: int) -> int:
        return self.max_tokens

    def probes(self, num_output_tokens: int) -> bool:
        # The scheduler's step gate passes a step with a probe: these rows
        # draft whatever their drafts are worth.
        return True

    def switch_off(self, num_output_tokens: int) -> None:
        raise AssertionError("the step gate passes a step with a probe")

    def record(self, proposed: int, accepted: int, num_output_tokens: int) -> None:
        pass


def run_batch(core: EngineCore, events: list[p.EngineEvent], tag: str, prompts: list[list[int]],
              tokens: int, cuda: bool, full_length: int = 0) -> tuple[float, list[list[int]]]:
    """Seconds to serve the prompts, and each one's output tokens; with
    full_length, every row drafts that many tokens every step."""
    events.clear()
    params = p.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    # The last run's garbage now, not as a full collection inside this
    # run's sub-second window.
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        core.handle(p.Generate(f"{tag}-{index}", prompt, params))
    if full_length:
        for seq in core.scheduler.waiting:
            seq.draft_length = FullLength(full_length)  # type: ignore[assignment]
    while core.has_work:
        core.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    found: dict[str, list[int]] = {f"{tag}-{index}": [] for index in range(len(prompts))}
    for event in events:
        if isinstance(event, p.StepOutputs):
            for output in event.outputs:
                found[output.request_id].extend(output.token_ids)
    return seconds, [found[f"{tag}-{index}"] for index in range(len(prompts))]


def describe(costs: dict[str, Any]) -> str:
    """A DraftCosts report in a few words."""
    text = f"costs {costs['verify_cost']:.2f} a draft token, {costs['step_cost']:.2f} a step"
    if not costs["measured"]:
        return text + " (the constants)"
    return (text + f" (b {costs['b'] * 1e6:.0f} us, c {costs['c'] * 1e6:.0f} us, "
            f"plain {costs['t_plain'] * 1e6:.0f} us at {costs['rows']} rows"
            f"{'' if costs['fitted'] else ', b from the constants'})")


def bench_shape(shape: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    cuda = device.type == "cuda"
    loaded = random_model(shape, device, dtype=torch.bfloat16 if cuda else torch.float32)
    vocab = loaded.config.vocab_size
    max_batch = max(args.batches)
    core, events = make_engine(loaded, device=device.type, dtype="bfloat16" if cuda else "float32",
                               spec="ngram", draft_tokens=max(args.drafts),
                               max_concurrency=max_batch, max_batched_tokens=4096,
                               max_context=PROMPT_TOKENS + args.tokens + 16,
                               deterministic=args.deterministic)
    # As the engine process does once built (engine/process/main.py): its
    # weights and graphs live as long as it does, out of full collections.
    freeze_long_lived(collect_first=True)
    scheduler = core.scheduler
    ngram = scheduler.drafter
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []

    def timed(tag: str, prompts: list[list[int]], drafter: WrongAtRate | None, k: int,
              full: bool = False) -> tuple[float, list[list[int]], dict[str, Any]]:
        scheduler.drafter = drafter
        scheduler.draft_tokens = k
        scheduler.draft_acceptance = DraftAcceptance()  # nothing of the last configuration
        cold: dict[str, Any] = {}
        if drafter is not None and not full:
            cold_s, cold_outputs = run_batch(core, events, f"cold-{tag}", prompts, args.tokens,
                                             cuda)
            cold = {"cold_seconds": cold_s, "cold_outputs": cold_outputs}
            drafter.proposed = 0
        stats = core._stats
        accepted, steps = stats.draft_accepted_tokens_total, stats.steps_total
        seconds, outputs = run_batch(core, events, tag, prompts, args.tokens, cuda,
                                     k if full else 0)
        accepted = stats.draft_accepted_tokens_total - accepted
        proposed = drafter.proposed if drafter is not None else 0
        return seconds, outputs, {"accepted": accepted, "proposed": proposed,
                                  "acceptance": accepted / proposed if proposed else 0.0,
                                  "steps": stats.steps_total - steps,
                                  "costs": scheduler.draft_costs.report(), **cold}

    for batch in args.batches:
        prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
        timed(f"warm-{batch}", prompts, None, 0)
        # The same prompts every run: their prefix is cached alike for all.
        plain_s, plain, plain_counts = timed(f"plain-{batch}", prompts, None, 0)
        plain_tok_s = batch * args.tokens / plain_s
        print(f"{shape} batch {batch}: plain {plain_tok_s:,.0f} tok/s, "
              f"{describe(plain_counts['costs'])}", flush=True)
        for k in args.drafts:
            # Every step verifies k drafts and keeps none: the cost of
            # speculation without the adaptive switch-off, and the target's
            # own greedy tokens as verify steps of this shape compute them
            # (in bf16 they may round a near tie differently from plain
            # decoding's steps), which the drafts below then propose.
            wrong = WrongAtRate([q + o for q, o in zip(prompts, plain, strict=True)], 1.0, vocab)
            ref_s, reference, ref_counts = timed(f"ref-k{k}-{batch}", prompts, wrong, k, full=True)
            runs = [q + o for q, o in zip(prompts, reference, strict=True)]
            configs = [("full, none kept", None, ref_s, reference, ref_counts)]
            for rate in args.wrong:
                drafter = WrongAtRate(runs, rate, vocab)
                seconds, outputs, counts = timed(f"k{k}-w{rate}-{batch}", prompts, drafter, k)
                configs.append((f"adaptive, wrong {rate:g}", rate, seconds, outputs, counts))
            for label, rate, seconds, outputs, counts in configs:
                cold_s = counts.pop("cold_seconds", None)
                cold_outputs = counts.pop("cold_outputs", None)
                row = {"shape": shape, "batch": batch, "draft_tokens": k, "config": label,
                       "wrong_rate": rate, "tok_s": batch * args.tokens / seconds,
                       "plain_tok_s": plain_tok_s, "ratio": plain_s / seconds, **counts,
                       "same_as_plain": outputs == plain,
                       "same_as_reference": outputs == reference}
                if cold_s is not None:
                    row.update(cold_ratio=plain_s / cold_s,
                               cold_same_as_plain=cold_outputs == plain)
                rows.append(row)
                cold_note = f" (cold {row['cold_ratio']:.2f}x)" if cold_s is not None else ""
                print(f"  K={k} {label}: {row['tok_s']:,.0f} tok/s = {row['ratio']:.2f}x plain"
                      f"{cold_note}, acceptance {row['acceptance']:.2f}, {row['steps']} steps, "
                      f"same as plain {row['same_as_plain']}; {describe(row['costs'])}",
                      flush=True)
    scheduler.drafter = ngram
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-8b,qwen3-0.6b")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--drafts", default="2,4,8")
    parser.add_argument("--wrong", default="0,0.3,1")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--deterministic", action="store_true",
                        help="the engine's --deterministic mode: every run's tokens equal plain's")
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.batches, args.drafts, args.tokens = "tiny", "1,2", "2", 8
    args.batches = [int(b) for b in args.batches.split(",")]
    args.drafts = [int(k) for k in args.drafts.split(",")]
    args.wrong = [float(w) for w in args.wrong.split(",")]
    device = torch.device("cpu" if args.smoke else "cuda")
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
        "device": "cpu" if args.smoke else torch.cuda.get_device_name(), "rows": []}
    for shape in args.shapes.split(","):
        results["rows"].extend(bench_shape(shape, args, device))
        gc.unfreeze()
        gc.collect()  # the shape's engine and weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.smoke:
        out = Path(os.environ.get("OUT", "."))
        (out / "bench_gpu_speculation.json").write_text(json.dumps(results, indent=2))
        if not args.deterministic:
            return 0
    # float32 on the CPU, or the batch-invariant mode: speculation is exact
    # whatever the rows' shapes.
    inexact = [row for row in results["rows"]
               if not row["same_as_plain"] or not row.get("cold_same_as_plain", True)]
    if inexact:
        print(f"{len(inexact)} runs differ from plain decoding", flush=True)
    return 1 if inexact else 0


if __name__ == "__main__":
    raise SystemExit(main())
