"""Timing of kernels.prefill_attention on the GPU (a script, not a test).

Run: .venv/bin/python tests/perf/bench_prefill_attention.py

For each (new tokens, seq_len) case, Qwen3-8B attention shape (Hq 32, Hkv 8,
D 128, pages of 16 tokens with shuffled page ids), it times our kernel and, as
a reference point in the same run, torch's flash SDPA (dense [1, Hq, T, D]
bf16 inputs with K/V repeat-interleaved to Hq heads, causal; the chunk over a
cached prefix uses the bottom-right causal bias, which torch sends to the
same flash kernel). Rates count causal FLOPs only: 4 * Hq * D * (visible
(query, key) pairs). Attention at these sizes is compute-bound, so the
ceiling that matters is the bf16 matrix rate, measured here with a cuBLAS
GEMM; the bytes column (Q, K, V read once, O written once) against the
device-copy bandwidth shows how far from memory-bound it is. The w32 / w16
columns are TFLOP/s of each kernel shape forced (the wrapper picks one by
grid size). Prints a table and writes JSON to
$OUT/bench_prefill_attention.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.prefill_attention import _prefill_attention, paged_prefill_attention

HQ, HKV, D, PAGE = 32, 8, 128, 16
CASES = [(1024, 1024), (8192, 8192), (512, 32768)]  # (new tokens, seq_len)


def time_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of fn() over iters runs, by CUDA events."""
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


def copy_bandwidth() -> float:
    """Device-copy bandwidth in GB/s: bytes read plus written over time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    """bf16 cuBLAS GEMM rate on random data (the tensor-core ceiling)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, iters=20)
    return 2 * n**3 / ms / 1e9


def causal_pairs(q_len: int, seq_len: int) -> int:
    # Row i of the chunk sees seq_len - q_len + i + 1 keys.
    context = seq_len - q_len
    return q_len * context + q_len * (q_len + 1) // 2


def bench_case(q_len: int, seq_len: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(q_len + seq_len)
    pages = -(-seq_len // PAGE)
    k_cache = torch.randn(pages, PAGE, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(pages, PAGE, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    # Shuffled page ids, as a long-running engine's pool hands them out.
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)[None]
    q = torch.randn(q_len, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    query_start_loc = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = D**-0.5

    def ours() -> None:
        paged_prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, table, scale,
                                q_len, out=out)

    ours_ms = time_ms(ours)
    # Each kernel shape forced, to check the wrapper's choice by grid size.
    variant_ms = {
        variant: time_ms(lambda variant=variant: _prefill_attention(
            q, k_cache, v_cache, query_start_loc, seq_lens, table, scale, q_len, out, variant))
        for variant in ("w32", "w16")
    }

    # Dense SDPA inputs: the cache's tokens in order, kv heads repeated.
    keys = k_cache[table[0].long()].flatten(0, 1)[:seq_len]  # [seq_len, Hkv, D]
    values = v_cache[table[0].long()].flatten(0, 1)[:seq_len]
    group = HQ // HKV
    k_dense = keys.transpose(0, 1).repeat_interleave(group, 0)[None].contiguous()
    v_dense = values.transpose(0, 1).repeat_interleave(group, 0)[None].contiguous()
    q_dense = q.transpose(0, 1)[None].contiguous()
    if q_len == seq_len:
        mask, is_causal = None, True
    else:
        mask, is_causal = causal_lower_right(q_len, seq_len), False
    sdpa_out: list[torch.Tensor] = []

    def sdpa() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_out[:] = [F.scaled_dot_product_attention(
                q_dense, k_dense, v_dense, attn_mask=mask, is_causal=is_causal, scale=scale)]

    try:
        sdpa_ms: float | None = time_ms(sdpa)
        reference = sdpa_out[0][0].transpose(0, 1).float()
        ours()
        torch.cuda.synchronize()
        rel_error: float | None = ((out.float() - reference).norm() / reference.norm()).item()
    except RuntimeError as error:  # no flash kernel for this case on this build
        print(f"SDPA flash failed for {(q_len, seq_len)}: {error}", file=sys.stderr)
        sdpa_ms = rel_error = None

    flops = 4 * HQ * D * causal_pairs(q_len, seq_len)
    # Fewest bytes: Q and O once, K and V of the sequence once.
    moved = 2 * q.numel() * 2 + 2 * seq_len * HKV * D * 2
    return {
        "q_len": q_len,
        "seq_len": seq_len,
        "tflop": flops / 1e12,
        "ours_ms": ours_ms,
        "ours_tflops": flops / ours_ms / 1e9,
        "ours_gbps": moved / ours_ms / 1e6,
        "w32_tflops": flops / variant_ms["w32"] / 1e9,
        "w16_tflops": flops / variant_ms["w16"] / 1e9,
        "sdpa_flash_ms": sdpa_ms,
        "sdpa_flash_tflops": None if sdpa_ms is None else flops / sdpa_ms / 1e9,
        "rel_error_vs_sdpa": rel_error,
    }


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    copy_gbps = copy_bandwidth()
    gemm_tflops = matmul_tflops()
    rows = [bench_case(q_len, seq_len) for q_len, seq_len in CASES]
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbps:.0f} GB/s, "
          f"bf16 cuBLAS GEMM {gemm_tflops:.0f} TFLOP/s")
    print(f"Hq {HQ}, Hkv {HKV}, D {D}, page {PAGE}; causal FLOPs only")
    header = (f"{'new':>6} {'seq_len':>7} {'ours ms':>9} {'TFLOP/s':>8} {'% gemm':>7} "
              f"{'GB/s':>6} {'w32':>5} {'w16':>5} {'flash ms':>9} {'TFLOP/s':>8} {'rel err':>8}")
    print(header)
    for row in rows:
        flash_ms = "-" if row["sdpa_flash_ms"] is None else f"{row['sdpa_flash_ms']:.3f}"
        flash_rate = "-" if row["sdpa_flash_tflops"] is None else f"{row['sdpa_flash_tflops']:.0f}"
        error = "-" if row["rel_error_vs_sdpa"] is None else f"{row['rel_error_vs_sdpa']:.1e}"
        print(f"{row['q_len']:>6} {row['seq_len']:>7} {row['ours_ms']:>9.3f} "
              f"{row['ours_tflops']:>8.0f} {100 * row['ours_tflops'] / gemm_tflops:>6.0f}% "
              f"{row['ours_gbps']:>6.0f} {row['w32_tflops']:>5.0f} {row['w16_tflops']:>5.0f} "
              f"{flash_ms:>9} {flash_rate:>8} {error:>8}")
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_gbps": copy_gbps,
        "gemm_tflops": gemm_tflops,
        "shape": {"hq": HQ, "hkv": HKV, "d": D, "page_size": PAGE},
        "cases": rows,
    }
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "bench_prefill_attention.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
