"""CPU benchmark of n-gram speculative decoding (issue 16) with real weights:
SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32), in-process
through the engine core, batch 1, greedy, the model's own chat template.

    .venv/bin/python tests/perf/bench_speculation_cpu.py [--threads 2] [--rounds 5]
                                                         [--max-tokens 200] [--draft-tokens 2,4,8]
    .venv/bin/python tests/perf/bench_speculation_cpu.py --smoke   # one tiny round

Three tasks: two whose answer copies from the prompt (rewrite a ~60-line
Python file with one function renamed; repeat a ~150-word passage) and one
that does not (a short story). Each runs with `--spec none` and with
`--spec ngram` at each draft length K, one engine per setting, all loaded at
once (on one copy of the weights); a round runs every task under every
setting (the settings' order turns each round, so that none is always first
after another's work) and each
figure is the best of the rounds: other work shares this machine.

Per task and setting: decode tokens/s (output tokens after the first, over
the time after the first; prefill is not what speculation changes),
acceptance (draft tokens accepted / drafted), tokens per decode step (all
steps after the first token; 1.0 without speculation), tokens per verify step
(the steps that carried a draft) and milliseconds per decode step (what
verifying K more tokens costs). Every run's tokens must equal those of `--spec none`, token
for token: the script stops with the first difference otherwise.

--smoke (tests/test_perf_smoke.py): one round of 8 tokens of the first task, none against
ngram K=4; its figures mean nothing. Writes $OUT/bench_speculation_cpu.json
when OUT is set (not in --smoke). Each run starts from a fresh engine's
draft acceptance (1: new rows draft the full K), whatever ran before it; the
draft costs each engine measures from its step times
(engine/sampling/draft_cost.py) are the machine's and the model's, so they
are kept from run to run, and printed and written ("draft_costs") at the end.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import protocol as p  # noqa: E402
from engine.loader import LoadedModel, load_model  # noqa: E402
from engine.sampling.draft_length import DraftAcceptance  # noqa: E402
from router.default_model import ensure_default_model  # noqa: E402
from router.text.model_text import ModelText  # noqa: E402

CODE_FILE = '''\
"""Stock levels for a small warehouse, read from and written to CSV."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    sku: str
    name: str
    quantity: int
    reorder_level: int


def load_inventory(path: Path) -> dict[str, Item]:
    """Read every row of the CSV file into items keyed by SKU."""
    items: dict[str, Item] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            item = Item(
                sku=row["sku"],
                name=row["name"],
                quantity=int(row["quantity"]),
                reorder_level=int(row["reorder_level"]),
            )
            items[item.sku] = item
    return items


def save_inventory(path: Path, items: dict[str, Item]) -> None:
    """Write the items back, sorted by SKU."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sku", "name", "quantity", "reorder_level"])
        for sku in sorted(items):
            item = items[sku]
            writer.writerow([item.sku, item.name, item.quantity, item.reorder_level])


def needs_reorder(items: dict[str, Item]) -> list[Item]:
    """Items at or below their reorder level."""
    return [item for item in items.values() if item.quantity <= item.reorder_level]


def receive(items: dict[str, Item], sku: str, count: int) -> None:
    """Add a delivery to the stock of one item."""
    if count <= 0:
        raise ValueError("a delivery adds at least one unit")
    items[sku].quantity += count


def main(path: Path) -> None:
    items = load_inventory(path)
    for item in needs_reorder(items):
        print(f"reorder {item.sku}: {item.name} ({item.quantity} left)")
    save_inventory(path, items)
'''

PASSAGE = (
    "A roundhouse is a circular building where railways kept and repaired their "
    "steam locomotives. At its centre sat a turntable, a short bridge of track on a "
    "pivot, which could turn a heavy engine to face any of the stalls arranged around "
    "it like the spokes of a wheel. Each stall had a pit beneath the rails so that "
    "workers could reach the running gear from below, and smoke jacks in the roof to "
    "carry away the fumes. An engine arriving after a long run would be turned, backed "
    "into its stall, cleaned of ash, and checked from boiler to wheels before its next "
    "journey. The design saved space in crowded rail yards and let one turntable serve "
    "dozens of locomotives. When diesel engines replaced steam, most roundhouses were "
    "torn down, but a few survive today as museums, workshops and concert halls, their "
    "curved walls still marking where the stalls once stood."
)

TASKS: dict[str, str] = {
    "rewrite code": "Rewrite this Python file with the function load_inventory renamed to "
                    "read_inventory:\n\n```python\n" + CODE_FILE + "```\n\nReturn the whole file.",
    "quote passage": "Repeat the following passage exactly, word for word:\n\n" + PASSAGE,
    "open chat": "Write a short story about a lighthouse.",
}


@dataclass
class Run:
    tokens: list[int]
    decode_seconds: float  # from the first output token to the last
    decode_steps: int  # outputs that carried tokens, after the first
    draft_steps: int  # of those, the ones that verified a draft
    drafted: int
    accepted: int


def build_core(weights: LoadedModel, model: Path, threads: int, spec: str,  # type: ignore[no-untyped-def]
               draft_tokens: int):
    """An engine on the weights read once for all settings: CPU engines only
    read them (tests/engine/in_process.py shares them the same way), and
    reading SmolLM2's GGUF took 5 s an engine."""
    from engine.process.bootstrap import assemble_engine

    options = p.EngineOptions(threads=threads, max_concurrency=1, max_context=2048,
                              kv_capacity_tokens=2048, spec=spec, draft_tokens=draft_tokens)
    # A model object of its own (the same weight tensors): the engine sets its ops on it.
    own = dataclasses.replace(weights, model=copy.copy(weights.model))
    events: list[p.EngineEvent] = []
    core, _ = assemble_engine(own, model, options, lambda fraction, message: None, events.append)
    return core, events


def generate(core, events: list[p.EngineEvent], prompt: list[int], max_tokens: int,  # type: ignore[no-untyped-def]
             stop_token_ids: list[int]) -> Run:
    events.clear()
    core.scheduler.kv.pool.clear_cache()  # every run computes its prompt
    # Every run starts as on a fresh engine, not from the acceptance the
    # tasks before it left (engine/sampling/draft_length.py), so each task's
    # figures are its own and every round drafts alike.
    core.scheduler.draft_acceptance = DraftAcceptance()
    # The engine has no end-of-sequence list of its own: the router sends the model's.
    params = p.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop_token_ids)
    core.handle(p.Generate("bench", prompt, params))
    seen = 0
    first_at = None
    while core.has_work:
        core.step()
        if first_at is None:
            for event in events[seen:]:
                if isinstance(event, p.StepOutputs) and any(o.token_ids for o in event.outputs):
                    first_at = time.perf_counter()
            seen = len(events)
    end = time.perf_counter()
    outputs = [o for e in events if isinstance(e, p.StepOutputs) for o in e.outputs
               if o.request_id == "bench" and o.token_ids]
    errors = [e for e in events if isinstance(e, p.RequestError)]
    if errors or first_at is None:
        raise SystemExit(f"the request failed: {errors}")
    return Run(tokens=[t for o in outputs for t in o.token_ids], decode_seconds=end - first_at,
               decode_steps=len(outputs) - 1,
               draft_steps=sum(1 for o in outputs if o.num_draft_tokens),
               drafted=sum(o.num_draft_tokens for o in outputs),
               accepted=sum(o.num_draft_accepted for o in outputs))


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def summary(runs: list[Run]) -> dict[str, Any]:
    run = runs[-1]  # greedy: every round's tokens and drafts are the same
    best = max((len(r.tokens) - 1) / r.decode_seconds for r in runs)
    return {
        "output_tokens": len(run.tokens),
        "decode_tok_s": best,
        "decode_tok_s_rounds": [(len(r.tokens) - 1) / r.decode_seconds for r in runs],
        "decode_steps": run.decode_steps,
        # The best round's, like decode_tok_s: what one step costs with its drafts.
        "ms_per_step": 1000 * min(r.decode_seconds / r.decode_steps for r in runs),
        "draft_steps": run.draft_steps,
        "drafted": run.drafted,
        "accepted": run.accepted,
        "acceptance": run.accepted / run.drafted if run.drafted else None,
        "tokens_per_step": (len(run.tokens) - 1) / run.decode_steps if run.decode_steps else None,
        "tokens_per_verify_step": 1 + run.accepted / run.draft_steps if run.draft_steps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--draft-tokens", default="2,4,8", help="the K values, comma-separated")
    parser.add_argument("--model", type=Path, help="a GGUF file or HF directory (default: SmolLM2)")
    parser.add_argument("--smoke", action="store_true", help="one round of 8 tokens, K=4 only")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.max_tokens, args.draft_tokens = 1, 8, "4"
    torch.set_num_threads(args.threads)
    model_path = args.model or ensure_default_model()
    text = ModelText.load(model_path)
    # The smoke run checks the script on one task that copies from its prompt.
    tasks = dict(list(TASKS.items())[:1]) if args.smoke else TASKS
    prompts = {name: text.encode_prompt(text.render_chat([{"role": "user", "content": content}]))
               for name, content in tasks.items()}
    stop = list(text.eos_token_ids)
    settings = [("none", 1)] + [("ngram", int(k)) for k in args.draft_tokens.split(",")]
    names = [spec if spec == "none" else f"ngram K={k}" for spec, k in settings]
    weights = load_model(model_path, torch.device("cpu"), torch.float32)
    engines = {name: build_core(weights, model_path, args.threads, spec, k)
               for name, (spec, k) in zip(names, settings, strict=True)}
    for core, events in engines.values():  # warm-up
        generate(core, events, next(iter(prompts.values())), 4, stop)

    runs: dict[tuple[str, str], list[Run]] = {}
    for round_index in range(args.rounds):
        turn = round_index % len(names)
        for task, prompt in prompts.items():
            for name in names[turn:] + names[:turn]:
                run = generate(*engines[name], prompt, args.max_tokens, stop)
                runs.setdefault((task, name), []).append(run)
            reference = runs[(task, "none")][-1].tokens
            for name in names[1:]:
                tokens = runs[(task, name)][-1].tokens
                if tokens != reference:
                    at = first_difference(reference, tokens)
                    raise SystemExit(
                        f"{task!r}, {name}: output differs from --spec none at token {at} "
                        f"(none: {reference[at:at + 8]}, {name}: {tokens[at:at + 8]}; "
                        f"lengths {len(reference)} and {len(tokens)})")
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)

    results: dict[str, dict[str, Any]] = {}
    for task in prompts:
        results[task] = {name: summary(runs[(task, name)]) for name in names}
        results[task]["prompt_tokens"] = len(prompts[task])  # type: ignore[assignment]
        results[task]["output_text"] = text.tokenizer.decode(runs[(task, "none")][-1].tokens)  # type: ignore[assignment]
    print(f"\n{'task':14s} {'setting':11s} {'tokens':>6s} {'tok/s':>7s} {'x none':>6s} "
          f"{'accept':>6s} {'tok/step':>8s} {'tok/verify':>10s} {'ms/step':>7s}")
    for task, by_setting in results.items():
        base = by_setting["none"]["decode_tok_s"]
        for name in names:
            row = by_setting[name]
            acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
            per_verify = ("-" if row["tokens_per_verify_step"] is None
                          else f"{row['tokens_per_verify_step']:.2f}")
            print(f"{task:14s} {name:11s} {row['output_tokens']:6d} {row['decode_tok_s']:7.1f} "
                  f"{row['decode_tok_s'] / base:6.2f} {acceptance:>6s} "
                  f"{row['tokens_per_step']:8.2f} {per_verify:>10s} {row['ms_per_step']:7.1f}")
    costs = {name: engines[name][0].scheduler.draft_costs.report() for name in names[1:]}
    print()
    for name, measured in costs.items():
        if not measured["measured"]:
            print(f"{name}: draft costs not measured yet (the constants)")
            continue
        print(f"{name}: a draft token costs {measured['verify_cost']:.3f} of a plain step, a "
              f"drafting step {measured['step_cost']:.3f} (b {measured['b'] * 1e3:.2f} ms, "
              f"c {measured['c'] * 1e3:.2f} ms, plain step {measured['t_plain'] * 1e3:.1f} ms"
              f"{'' if measured['fitted'] else ', b from the constants'})")
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads, "rounds": args.rounds, "max_tokens": args.max_tokens,
        "model": model_path.name, "torch": torch.__version__,
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT).stdout.strip(),
        "tasks": results,
        "draft_costs": costs,
    }
    out = os.environ.get("OUT")
    if out and not args.smoke:
        Path(out, "bench_speculation_cpu.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
