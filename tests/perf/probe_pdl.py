"""Programmatic Dependent Launch (issue 13): batch-1 decode at the Qwen3-0.6B
shape with our kernels' PDL off and on, in one process.

    python tests/perf/probe_pdl.py --out $OUT/probe_pdl.json [--rounds 12 --replays 100]
        [--only chain,engine,fused]

Two graphs, each captured twice (kernels.cuda_build.set_pdl off, then on):
  engine: the engine's own batch-1 decode forward (DecodeGraphs._forward:
          embedding, 28 layers, final norm, lm_head into the logits buffer)
          of a random-weight model at the 0.6B shape, after a 32-token prompt
          and a few decode steps through the engine's step loop;
  fused:  the engine's graph again, PDL on both times, with the dense layers
          unfused and then fused (kernels/skinny_fused.py: six kernels a
          layer instead of nine); "off" and "on" in its JSON are unfused
          and fused, which must give the same bits;
  chain:  our kernels alone at the 0.6B shapes, 28 layers of add_rms_norm,
          qkv [4096 x 1024], o [1024 x 2048] (on q's columns; no attention),
          add_rms_norm, gate_up [6144 x 1024], silu_and_mul, down [1024 x 3072].
Correctness: the PDL-on graph's output has the PDL-off graph's bits (logits
poisoned with NaN before each replay; off replayed twice to show it is
repeatable), on three decode steps for the engine and three fresh inputs
for the chain, and only the PDL-on graphs have programmatic edges.
Timing: median device time of one replay (CUDA events around blocks of
replays, off and on blocks interleaved, order alternating each round, after
warm-up), the spread of the per-round medians, and for the engine graph the
tok/s and share of the roofline (measured copy bandwidth over the bytes a
step must read). Exits 1 when any check fails. Needs a CUDA GPU and CuPy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels import cuda_build  # noqa: E402

BF16 = torch.bfloat16
HIDDEN, Q_SIZE, KV_SIZE, INTERMEDIATE, LAYERS = 1024, 2048, 1024, 3072, 28
EPS = 1e-6
T = TypeVar("T")
CASES = ("chain", "engine", "fused")


def capture(run: Callable[[], T], pdl: bool) -> tuple[torch.cuda.CUDAGraph, T]:
    """run captured with PDL on or off (keep_graph: its edges are read)."""
    previous = cuda_build.set_pdl(pdl)
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.inference_mode(), torch.cuda.graph(graph):
            out = run()
        graph.instantiate()
    finally:
        cuda_build.set_pdl(previous)
    return graph, out


def replay_bits(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> torch.Tensor:
    # (out was made under inference mode, inside the capture.)
    with torch.inference_mode():
        out.fill_(float("nan"))  # every element must be written again
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()


def check_bits(graphs: dict[bool, tuple[torch.cuda.CUDAGraph, torch.Tensor]]) -> dict[str, Any]:
    """off, on, off again: on must equal off bit for bit, off itself repeatable."""
    off = replay_bits(*graphs[False])
    on = replay_bits(*graphs[True])
    off_again = replay_bits(*graphs[False])
    return {"repeatable": bool(torch.equal(off, off_again)), "equal": bool(torch.equal(on, off)),
            "finite": bool(torch.isfinite(off.float()).all()),
            "max_abs_diff": float((on.float() - off.float()).abs().nan_to_num(float("inf")).max())}


def time_graphs(graphs: dict[bool, torch.cuda.CUDAGraph], rounds: int, replays: int
                ) -> dict[bool, list[float]]:
    """Per round and mode, the device time of one replay in microseconds
    (one event pair around `replays` back-to-back replays)."""
    for graph in graphs.values():
        for _ in range(10):
            graph.replay()
    torch.cuda.synchronize()
    times: dict[bool, list[float]] = {pdl: [] for pdl in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for index in range(rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        for pdl in order:
            start.record()
            for _ in range(replays):
                graphs[pdl].replay()
            end.record()
            end.synchronize()
            times[pdl].append(start.elapsed_time(end) * 1e3 / replays)
    return times


def summary(times: dict[bool, list[float]]) -> dict[str, Any]:
    def stats(values: list[float]) -> dict[str, float]:
        half = len(values) // 2
        return {"median_us": statistics.median(values), "min_us": min(values),
                "max_us": max(values),
                # The same version timed twice: first and second half of the rounds.
                "first_half_median_us": statistics.median(values[:half]),
                "second_half_median_us": statistics.median(values[half:])}
    off, on = stats(times[False]), stats(times[True])
    return {"off": off, "on": on, "speedup": off["median_us"] / on["median_us"],
            "rounds_us": {"off": times[False], "on": times[True]}}


def edges(graphs: dict[bool, tuple[torch.cuda.CUDAGraph, Any]]) -> dict[str, list[int]]:
    from tests.kernels.graph_edges import edge_counts

    return {("on" if pdl else "off"): list(edge_counts(graph)) for pdl, (graph, _) in
            graphs.items()}


def engine_case(rounds: int, replays: int, bandwidth: float, fused_off_on: bool = False
                ) -> dict[str, Any]:
    """The engine's batch-1 decode graph, PDL off and on (fused layers as the
    engine runs them); fused_off_on: PDL on, the dense layers unfused and
    fused (kernels/skinny_fused.py) instead."""
    import protocol as p
    from tests.perf import gpu_models

    loaded = gpu_models.random_model("qwen3-0.6b", torch.device("cuda"))
    core, _ = gpu_models.make_engine(loaded, max_concurrency=1, max_batched_tokens=2048,
                                     max_context=4096, kv_capacity_tokens=16384)
    rng = random.Random(0)
    prompt = [rng.randrange(gpu_models.QWEN3_TEXT_VOCAB) for _ in range(32)]
    params = p.SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    core.handle(p.Generate("probe", prompt, params))
    for _ in range(8):
        core.step()
    torch.cuda.synchronize()
    decode = core.runner.graphs
    assert decode is not None, "the engine captured no decode graphs"
    bucket = decode.buckets[0]
    logits = decode.memory.logits[:1]

    def forward() -> None:
        decode._forward(1, bucket)

    ops = core.runner.model.ops
    graphs = {}
    for mode in (False, True):
        if fused_off_on:
            ops.fuse_layers = mode
        graphs[mode] = (capture(forward, mode or fused_off_on)[0], logits)
    checks = []
    for _ in range(3):
        core.step()  # a new token, position and KV row in the static inputs
        torch.cuda.synchronize()
        checks.append(check_bits(graphs))
    result = summary(time_graphs({pdl: g for pdl, (g, _) in graphs.items()}, rounds, replays))
    step_bytes = gpu_models.decode_step_bytes(loaded)
    floor_us = step_bytes / bandwidth * 1e6
    for mode in ("off", "on"):
        median = result[mode]["median_us"]
        result[mode]["tok_s"] = 1e6 / median
        result[mode]["roofline_share"] = floor_us / median
    result.update(checks=checks, edges=edges(graphs), floor_us=floor_us, step_bytes=step_bytes)
    del graphs, core
    return result


def chain_case(rounds: int, replays: int) -> dict[str, Any]:
    from kernels.activation import silu_and_mul
    from kernels.norm import add_rms_norm
    from kernels.skinny_gemm import skinny_linear

    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=generator)).to(BF16)

    layers = [{
        "qkv": randn(Q_SIZE + 2 * KV_SIZE, HIDDEN, scale=HIDDEN**-0.5),
        "o": randn(HIDDEN, Q_SIZE, scale=Q_SIZE**-0.5),
        "gate_up": randn(2 * INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5),
        "down": randn(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5),
        "norm_in": 1.0 + randn(HIDDEN, scale=0.1), "norm_post": 1.0 + randn(HIDDEN, scale=0.1),
    } for _ in range(LAYERS)]
    final_norm = 1.0 + randn(HIDDEN, scale=0.1)
    x = randn(1, HIDDEN, scale=1.0)
    residual0 = randn(1, HIDDEN, scale=1.0)

    def run() -> torch.Tensor:
        residual = residual0.clone()
        hidden = x
        for layer in layers:
            normed, residual = add_rms_norm(hidden, residual, layer["norm_in"], EPS)
            qkv = skinny_linear(normed, layer["qkv"])
            attn = skinny_linear(qkv[:, :Q_SIZE], layer["o"])
            normed, residual = add_rms_norm(attn, residual, layer["norm_post"], EPS)
            hidden = skinny_linear(silu_and_mul(skinny_linear(normed, layer["gate_up"])),
                                   layer["down"])
        return add_rms_norm(hidden, residual, final_norm, EPS)[0]

    with torch.inference_mode():
        run()
    torch.cuda.synchronize()
    graphs = {pdl: capture(run, pdl) for pdl in (False, True)}
    checks = []
    for seed in range(1, 4):
        x.copy_(torch.randn(1, HIDDEN, device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(seed)))
        check = check_bits(graphs)
        with torch.inference_mode():
            check["equals_eager"] = bool(torch.equal(graphs[True][1], run()))
        checks.append(check)
    result = summary(time_graphs({pdl: g for pdl, (g, _) in graphs.items()}, rounds, replays))
    result.update(checks=checks, edges=edges(graphs), kernels_per_replay=1 + 7 * LAYERS)
    return result


def passed(case: dict[str, Any], name: str) -> bool:
    bits_ok = all(c["equal"] and c["repeatable"] and c["finite"] and c.get("equals_eager", True)
                  for c in case["checks"])
    # The fused case has PDL on both times; the others off, then on.
    off_programmatic = case["edges"]["off"][1]
    return (bits_ok and case["edges"]["on"][1] > 0
            and (off_programmatic > 0 if name == "fused" else off_programmatic == 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "probe_pdl.json"))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--only", default="chain,engine")
    args = parser.parse_args()
    if args.rounds < 2 or args.replays < 1:
        parser.error("--rounds must be at least 2 (two halves) and --replays at least 1")
    if not cuda_build.cuda_available():
        print("probe_pdl needs a CUDA GPU and CuPy (it captures and times CUDA graphs); "
              "none here.", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability()[0] < 9:
        print("probe_pdl needs Hopper or newer (griddepcontrol is sm_90+).", file=sys.stderr)
        return 2
    from tests.perf.gpu_models import copy_bandwidth

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "copy_bandwidth_bytes_s": bandwidth, "rounds": args.rounds, "replays": args.replays,
        "env_ROUNDHOUSE_PDL": os.environ.get("ROUNDHOUSE_PDL"),
    }
    only = set(args.only.split(","))
    if "chain" in only:
        results["chain"] = chain_case(args.rounds, args.replays)
        torch.cuda.empty_cache()
    if "engine" in only:
        results["engine"] = engine_case(args.rounds, args.replays, bandwidth)
        torch.cuda.empty_cache()
    if "fused" in only:
        results["fused"] = engine_case(args.rounds, args.replays, bandwidth, fused_off_on=True)
    ok = all(passed(results[name], name) for name in CASES if name in results)
    results["passed"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))

    print(f"\n{results['device']}, copy {bandwidth / 1e12:.2f} TB/s; JSON: {args.out}")
    print(f"{'graph':8} {'PDL off us':>11} {'PDL on us':>10} {'speedup':>8} "
          f"{'spread off/on us':>20} {'prog. edges':>12} {'bits':>5}")
    for name in CASES:
        if name not in results:
            continue
        case = results[name]
        spread = (f"{case['off']['max_us'] - case['off']['min_us']:.1f}/"
                  f"{case['on']['max_us'] - case['on']['min_us']:.1f}")
        bits = "ok" if passed(case, name) else "FAIL"
        print(f"{name:8} {case['off']['median_us']:11.1f} {case['on']['median_us']:10.1f} "
              f"{case['speedup']:8.3f} {spread:>20} {case['edges']['on'][1]:>12} {bits:>5}")
    if "engine" in results:
        engine = results["engine"]
        print(f"engine batch-1: {engine['off']['tok_s']:.0f} -> {engine['on']['tok_s']:.0f} tok/s "
              f"(graph replay only), roofline share {engine['off']['roofline_share']:.1%} -> "
              f"{engine['on']['roofline_share']:.1%} (floor {engine['floor_us']:.0f} us)")
    if "fused" in results:
        fused = results["fused"]
        print(f"engine batch-1, PDL on, dense layers unfused -> fused: "
              f"{fused['off']['tok_s']:.0f} -> {fused['on']['tok_s']:.0f} tok/s, roofline share "
              f"{fused['off']['roofline_share']:.1%} -> {fused['on']['roofline_share']:.1%}")
    print("PASS" if ok else "FAIL: see checks and edges in the JSON")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
