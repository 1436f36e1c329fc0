"""A draft model's cost per drafting round (issue 16's H200 benchmark): the
0.6B shape drafting for the 8B shape, random weights, with and without the
draft's CUDA graphs, timed against plain decoding in the same run.

    python tests/perf/bench_gpu_draft_model.py [--target qwen3-8b] [--draft qwen3-0.6b]
        [--batches 1,8] [--drafts 2,4,8] [--tokens 128] [--smoke]

Random weights agree on nothing, so no draft is kept: every row drafts its
full K every step (the adaptive switch-off pinned off, as
bench_gpu_speculation.py's reference runs do) and each step verifies K
rejected tokens. Reported per batch and K: plain decode tok/s; the drafting
run's tok/s and its ratio to plain (the worst case a draft model that is
never right costs without the switch-off); the draft's own time per round
(propose_batch's wall time: it ends with reading the draft back, and the
engine runs nothing else meanwhile) in milliseconds and in plain decode
steps; and the share of rounds the graphs served. The tokens are checked
equal to plain decoding's (greedy speculation is exact within the
batch-invariant regime: batch x (1 + K) <= 8 rows on the GPU, always in
float32 on the CPU).

--smoke runs the tiny shape drafting for itself on the CPU in seconds
(tests/test_perf_smoke.py). Writes $OUT/bench_gpu_draft_model.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.execution.cuda_graphs import decode_row_capacity
from engine.execution.model_ops import kernels_usable, make_ops
from engine.sampling.draft_model import DraftModelDrafter
from router.heap import freeze_long_lived
from tests.perf.bench_gpu_speculation import PROMPT_TOKENS, run_batch
from tests.perf.gpu_models import make_engine, random_model


class TimedDrafter:
    """A DraftModelDrafter whose rounds are timed."""

    def __init__(self, drafter: DraftModelDrafter) -> None:
        self.drafter = drafter
        self.seconds = 0.0
        self.rounds = 0
        self.proposed = 0

    def propose(self, token_ids: Any, max_tokens: int) -> list[int]:
        return self.drafter.propose(token_ids, max_tokens)

    def propose_batch(self, rows: Any) -> list[list[int]]:
        started = time.perf_counter()
        drafts = self.drafter.propose_batch(rows)
        self.seconds += time.perf_counter() - started
        self.rounds += 1
        self.proposed += sum(len(draft) for draft in drafts)
        return drafts

    def forget(self, key: str) -> None:
        self.drafter.forget(key)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen3-8b")
    parser.add_argument("--draft", default="qwen3-0.6b")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--drafts", default="2,4,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    freeze_long_lived(collect_first=True)
    if args.smoke:
        args.target, args.draft, args.batches, args.drafts, args.tokens = "tiny", "tiny", "1,2", \
            "2", 6
    batches = [int(b) for b in args.batches.split(",")]
    drafts = [int(k) for k in args.drafts.split(",")]
    device = torch.device("cpu" if args.smoke else "cuda")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    target = random_model(args.target, device, dtype=dtype)
    # Another seed: a draft that agrees with the target by chance only
    # (in the smoke run the same tiny shape, its drafts then all kept).
    draft = random_model(args.draft, device, seed=0 if args.smoke else 1, dtype=dtype)
    max_batch, max_k = max(batches), max(drafts)
    max_context = PROMPT_TOKENS + args.tokens + max_k + 16
    core, events = make_engine(target, device=device.type, dtype=str(dtype).split(".")[-1],
                               spec="ngram", draft_tokens=max_k, max_concurrency=max_batch,
                               max_batched_tokens=4096, max_context=max_context)
    rows_cap = decode_row_capacity(max_batch, max_k)
    draft.model.ops = make_ops(draft.config, device,
                               use_kernels=kernels_usable(device, dtype, draft.config),
                               max_batch=rows_cap, max_context=max_context)
    page_size = core.scheduler.kv.page_size
    vocab_limit = min(target.config.vocab_size, draft.config.vocab_size)
    scheduler = core.scheduler
    rng = random.Random(0)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": []}
    for graphs in ([False, True] if cuda else [False]):
        drafter = DraftModelDrafter(draft.model, num_pages=(max_context // page_size + 2)
                                    * max_batch + 8, page_size=page_size,
                                    max_step_tokens=4096, vocab_limit=vocab_limit, device=device)
        if graphs:
            drafter.enable_graphs(catch_up_rows=rows_cap, max_rows=max_batch, max_tokens=max_k,
                                  max_context=max_context)
        for batch in batches:
            prompts = [[rng.randrange(vocab_limit) for _ in range(PROMPT_TOKENS)]
                       for _ in range(batch)]
            scheduler.drafter, scheduler.draft_tokens = None, 0
            run_batch(core, events, f"warm-{graphs}-{batch}", prompts, args.tokens, cuda)
            plain_s, plain = run_batch(core, events, f"plain-{graphs}-{batch}", prompts,
                                       args.tokens, cuda)
            step_ms = 1000 * plain_s / args.tokens
            for k in drafts:
                timed = TimedDrafter(drafter)
                scheduler.drafter, scheduler.draft_tokens = timed, k
                before = drafter.graph_rounds
                seconds, outputs = run_batch(core, events, f"d{graphs}-{k}-{batch}", prompts,
                                             args.tokens, cuda, full_length=k)
                round_ms = 1000 * timed.seconds / max(timed.rounds, 1)
                row = {"target": args.target, "draft": args.draft, "graphs": graphs,
                       "batch": batch, "draft_tokens": k,
                       "plain_tok_s": batch * args.tokens / plain_s, "plain_step_ms": step_ms,
                       "tok_s": batch * args.tokens / seconds, "ratio": plain_s / seconds,
                       "rounds": timed.rounds, "round_ms": round_ms,
                       "round_in_plain_steps": round_ms / step_ms,
                       "graph_share": (drafter.graph_rounds - before) / max(timed.rounds, 1),
                       "same_as_plain": outputs == plain}
                results["rows"].append(row)
                print(f"graphs {graphs} batch {batch} K={k}: plain {row['plain_tok_s']:,.0f} "
                      f"tok/s ({step_ms:.2f} ms/step), drafting {row['tok_s']:,.0f} tok/s = "
                      f"{row['ratio']:.2f}x; a round {round_ms:.2f} ms = "
                      f"{row['round_in_plain_steps']:.2f} plain steps, graphs "
                      f"{row['graph_share']:.0%} of rounds, same as plain "
                      f"{row['same_as_plain']}", flush=True)
    scheduler.drafter = None
    if not args.smoke:
        out = Path(os.environ.get("OUT", "."))
        (out / "bench_gpu_draft_model.json").write_text(json.dumps(results, indent=2))
        return 0
    inexact = [row for row in results["rows"] if not row["same_as_plain"]]
    return 1 if inexact else 0


if __name__ == "__main__":
    raise SystemExit(main())
