"""Timing of the gated delta rule over one prompt on the GPU: the recurrent
kernel (kernels/gated_delta.py, a step per token) against the chunked form
in torch (kernels/gated_delta_chunked.py, matrix products per 64-token
chunk) and in one tensor-core kernel (kernels/gated_delta_tc.py).

    python tests/perf/bench_gated_delta_prefill.py [--tokens 16,64,256,1024,8192,32768] [--smoke]

One fresh sequence per case at Qwen3.5-35B-A3B's linear-attention shape
(Hk 16, Hv 32, Dk = Dv = 128), bf16 operands with strided rows as the layer
passes them; CUDA-event timed (median). Per case: ms of each form, us per
token (one layer; the model has 30 such layers), the speed-ups over the
recurrent kernel, the torch chunked form's peak extra memory, and the
largest output difference of each chunked form from the recurrent kernel
(bf16 outputs of one float32 recurrence: about a bf16 rounding step).
MIN_CHUNKED_TOKENS in kernels/gated_delta_chunked.py should sit where the
torch form's speed-up crosses 1, MIN_TC_TOKENS in kernels/gated_delta_tc.py
where the tensor-core kernel's does. Writes $OUT/bench_gated_delta_prefill.json when OUT is set.

--smoke runs the chunked form on the CPU at a tiny shape against the
reference, in seconds (tests/test_perf_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.gated_delta_chunked import MIN_CHUNKED_TOKENS, gated_delta_rule_chunked
from kernels.gated_delta_reference import gated_delta_rule, gdn_gating

QWEN35 = (16, 32, 128, 128)  # (Hk, Hv, Dk, Dv)
TINY = (2, 4, 16, 16)


def make_case(tokens: int, shape: tuple[int, int, int, int], device: torch.device,
              dtype: torch.dtype) -> dict[str, torch.Tensor]:
    hk, hv, dk, dv = shape
    gen = torch.Generator(device=device).manual_seed(tokens)
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, device=device, generator=gen).to(dtype)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    ab = torch.randn(tokens, 2 * hv, device=device, generator=gen).to(dtype)
    return {"q": q.view(tokens, hk, dk), "k": k.view(tokens, hk, dk),
            "v": v.view(tokens, hv, dv), "a": ab[:, :hv], "b": ab[:, hv:],
            "a_log": torch.rand(hv, device=device, generator=gen) * math.log(16.0),
            "dt_bias": torch.randn(hv, device=device, generator=gen) * 0.5}


def operands(case: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(case[name] for name in ("q", "k", "v", "a", "b", "a_log", "dt_bias"))


def time_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_case(tokens: int) -> dict[str, float]:
    from kernels.gated_delta import gated_delta_rule as recurrent
    from kernels.gated_delta_tc import gated_delta_rule_tc

    device = torch.device("cuda")
    _, hv, dk, dv = QWEN35
    case = make_case(tokens, QWEN35, device, torch.bfloat16)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    fresh = torch.ones(1, dtype=torch.bool, device=device)
    states = torch.zeros(1, hv, dk, dv, device=device)
    out = torch.empty(tokens, hv, dv, dtype=torch.bfloat16, device=device)
    chunked_out = torch.empty_like(out)
    tc_out = torch.empty_like(out)

    def run_recurrent() -> None:
        recurrent(*operands(case), states, slots, fresh, qsl, out=out)

    def run_chunked() -> None:
        gated_delta_rule_chunked(*operands(case), states, slots, fresh, (0, tokens),
                                 out=chunked_out)

    def run_tc() -> None:
        gated_delta_rule_tc(*operands(case), states, slots, fresh, qsl, out=tc_out)

    recurrent_ms = time_ms(run_recurrent)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    chunked_ms = time_ms(run_chunked)
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    tc_ms = time_ms(run_tc)
    run_recurrent()
    run_chunked()
    run_tc()
    diff = (out.float() - chunked_out.float()).abs().max().item()
    tc_diff = (out.float() - tc_out.float()).abs().max().item()
    return {"tokens": tokens, "recurrent_ms": recurrent_ms, "chunked_ms": chunked_ms,
            "tc_ms": tc_ms, "recurrent_us_per_token": 1e3 * recurrent_ms / tokens,
            "chunked_us_per_token": 1e3 * chunked_ms / tokens,
            "tc_us_per_token": 1e3 * tc_ms / tokens,
            "speedup": recurrent_ms / chunked_ms, "tc_speedup": recurrent_ms / tc_ms,
            "chunked_peak_mib": peak_mib, "max_abs_diff": diff, "tc_max_abs_diff": tc_diff}


def smoke() -> int:
    """The chunked form against the reference on the CPU, tiny shape."""
    for tokens in (65, 200):
        case = make_case(tokens, TINY, torch.device("cpu"), torch.float32)
        states = torch.randn(2, *TINY[1:2], TINY[2], TINY[3]) * 0.3
        expected_states = states.clone()
        slots, fresh = torch.tensor([1]), torch.tensor([False])
        start = time.perf_counter()
        got = gated_delta_rule_chunked(*operands(case), states, slots, fresh, (0, tokens))
        seconds = time.perf_counter() - start
        g, beta = gdn_gating(case["a"], case["b"], case["a_log"], case["dt_bias"])
        expected = gated_delta_rule(case["q"], case["k"], case["v"], g, beta, expected_states,
                                    slots, fresh, (0, tokens))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)
        print(f"smoke: {tokens} tokens chunked on the CPU in {seconds * 1e3:.1f} ms, "
              "equal to the reference")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,64,256,1024,8192,32768",
                        help="prompt lengths, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    print(f"Hk/Hv/Dk/Dv {QWEN35}, one fresh sequence, one layer; "
          f"MIN_CHUNKED_TOKENS = {MIN_CHUNKED_TOKENS}")
    print(f"{'tokens':>7} {'recurrent ms':>13} {'chunked ms':>11} {'tc ms':>9} "
          f"{'rec us/tok':>11} {'chk us/tok':>11} {'tc us/tok':>10} {'chk x':>7} "
          f"{'tc x':>7} {'peak MiB':>9} {'chk diff':>9} {'tc diff':>9}")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = bench_case(tokens)
        rows.append(row)
        print(f"{tokens:>7} {row['recurrent_ms']:>13.3f} {row['chunked_ms']:>11.3f} "
              f"{row['tc_ms']:>9.3f} {row['recurrent_us_per_token']:>11.3f} "
              f"{row['chunked_us_per_token']:>11.3f} {row['tc_us_per_token']:>10.3f} "
              f"{row['speedup']:>7.2f} {row['tc_speedup']:>7.2f} "
              f"{row['chunked_peak_mib']:>9.0f} {row['max_abs_diff']:>9.2e} "
              f"{row['tc_max_abs_diff']:>9.2e}", flush=True)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_gated_delta_prefill.json"
        path.write_text(json.dumps({"shape": QWEN35, "cases": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
