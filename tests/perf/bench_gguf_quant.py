"""GPU timing of kernels.gguf_quant: the packed-weight GEMV for decode, and
dequantize_to + F.linear (cuBLAS) for prefill-sized batches.

    python tests/perf/bench_gguf_quant.py          (on the GPU machine; JSON to $OUT)
    python tests/perf/bench_gguf_quant.py --types Q8_0,Q4_K,Q6_K --rows 1,2,4 --gemv-only
    python tests/perf/bench_gguf_quant.py --smoke  (CPU, seconds: the shape,
                                                    byte and layout tables, no CUDA)

GEMV: for each type and the decode projections of Qwen3-0.6B and Qwen3-8B, M
= 1, 2, 4, 8 and 16 rows (--rows), the device time per call of each kernel:
the CUDA-core one (quant_gemv_cuda_cores, rows <= CUDA_CORE_GEMV_MAX_ROWS
where its staged x fits), the tensor-core one (quant_gemv_tensor_cores) and
F.linear on a bf16 weight of the same shape. CALLS_PER_GRAPH calls captured
in one CUDA graph and replayed (median of the replays over the calls), the
calls rotating over enough copies of the weight that one pass is at least
twice the 60 MB L2, so the weight comes from HBM as in a real decode step.
Bandwidth = the weight's bytes (+ x read, out written) / time, set against a
2 GiB device-to-device copy (bytes read + written) measured in the same run:
the issue's target is >= 75% of that at batch 1 for Q8_0 and Q4_K at the
8B shape; bf16's own percentage is the bar the packed kernels should meet.

Prefill: at M = 256 and 1024 and the 8B shapes, dequantize_to into one
scratch buffer followed by F.linear, against F.linear on a bf16 weight
(the alternative to a fused tensor-core GEMM that the issue asks to measure),
and dequantize_to alone in GB/s (packed read + bf16 written).

The weights are random blocks with finite float16 scales (timing does not
depend on the values; the tests check them against gguf). "diff" is the
GEMV's relative difference from F.linear on its own dequantized weight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels import gguf_quant  # noqa: E402
from kernels.gguf_quant import (  # noqa: E402
    CUDA_CORE_GEMV_MAX_ROWS,
    CUDA_CORE_GEMV_ROWS,
    GGUF_KERNEL_TYPES,
    QUANT_GEMV_MAX_ROWS,
    cuda_core_gemv_fits,
    dequantize_to,
    packed_row_bytes,
    quant_gemv,
    quant_gemv_cuda_cores,
    quant_gemv_tensor_cores,
)

L2_BYTES = 60 * 2**20
GEMV_ROWS = (1, 2, 4, 8, 16)
H200_SMS = 132  # for the --smoke layout table
PREFILL_ROWS = (256, 1024)
# name: (N, K) of weight [N, K]
SHAPES = {
    "0.6B qkv": (4096, 1024),
    "0.6B o_proj": (1024, 2048),
    "0.6B gate_up": (6144, 1024),
    "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096),
    "8B o_proj": (4096, 4096),
    "8B gate_up": (24576, 4096),
    "8B down": (4096, 12288),
}
PREFILL_SHAPES = ("8B qkv", "8B gate_up", "8B down")
CALLS_PER_GRAPH = 32
REPLAYS = 20
MAX_COPIES = 32
BF16 = torch.bfloat16
# qtype -> (elements per block, bytes per block, offsets of float16 scales)
BLOCKS = {8: (32, 34, (0,)), 2: (32, 18, (0,)), 12: (256, 144, (0, 2)), 13: (256, 176, (0, 2)),
          14: (256, 210, (208,))}


def byte_table() -> list[dict]:
    """Packed bytes of every shape in every type, and the ratio to bf16."""
    rows = []
    for name, (n, k) in SHAPES.items():
        for qtype, type_name in GGUF_KERNEL_TYPES.items():
            nbytes = n * packed_row_bytes(qtype, k)
            rows.append({"shape": name, "type": type_name, "n": n, "k": k, "packed_bytes": nbytes,
                         "bits_per_weight": 8 * nbytes / (n * k)})
    return rows


def random_blocks(qtype: int, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Packed uint8 [N, row_bytes] of random blocks with finite scales, made
    on the GPU (gguf's numpy quantizer would take minutes at these sizes)."""
    block, size, scale_offsets = BLOCKS[qtype]
    raw = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, device="cuda",
                        generator=generator)
    for offset in scale_offsets:
        scales = (torch.rand(n, k // block, device="cuda", generator=generator) + 0.5) / k**0.5
        if qtype == 14:
            scales /= 32
        raw[:, :, offset:offset + 2] = scales.half().view(torch.uint8).view(n, k // block, 2)
    return raw.view(n, -1)


def copies_for(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, -(-2 * L2_BYTES // nbytes)))


def bench_gemv(qtype: int, name: str, n: int, k: int, copy_gb: float, rows_list: list[int],
               generator: torch.Generator) -> list[dict]:
    from kernels.cuda_build import sm_count
    from tests.perf import gpu_models

    packed_bytes = n * packed_row_bytes(qtype, k)
    copies = copies_for(packed_bytes)
    weights = [random_blocks(qtype, n, k, generator) for _ in range(copies)]
    bf16_copies = copies_for(2 * n * k)
    bf16_weights = [torch.randn(n, k, device="cuda", generator=generator).to(BF16)
                    for _ in range(bf16_copies)]
    dense = torch.empty(n, k, device="cuda", dtype=BF16)
    dequantize_to(weights[0], qtype, dense)
    results = []
    for rows in rows_list:
        xs = [torch.randn(rows, k, device="cuda", generator=generator).to(BF16)
              for _ in range(copies)]
        outs = [torch.empty(rows, n, device="cuda", dtype=BF16) for _ in range(copies)]
        order = [i % copies for i in range(CALLS_PER_GRAPH)]
        kernels = {"tensor_cores": quant_gemv_tensor_cores}
        if cuda_core_gemv_fits(rows, n, k, qtype, sm_count(0)):
            kernels["cuda_cores"] = quant_gemv_cuda_cores
        nbytes = packed_bytes + rows * k * 2 + rows * n * 2
        ref = F.linear(xs[0], dense).double()
        row = {"type": GGUF_KERNEL_TYPES[qtype], "shape": name, "n": n, "k": k, "rows": rows,
               "bytes": nbytes, "weight_copies": copies,
               "quant_gemv_uses": ("cuda_cores" if "cuda_cores" in kernels
                                   and rows <= CUDA_CORE_GEMV_ROWS[qtype] else "tensor_cores")}
        for label, gemv in kernels.items():
            calls = [partial(gemv, xs[i], weights[i], qtype, out=outs[i]) for i in order]
            us = gpu_models.graph_time_us(calls, replays=REPLAYS)
            diff = float((gemv(xs[0], weights[0], qtype).double() - ref).norm() / ref.norm())
            row[f"{label}_us"] = us
            row[f"{label}_fraction_of_copy"] = nbytes / us * 1e-3 / copy_gb
            row[f"{label}_rel_diff_vs_dequantized_linear"] = diff
        bf16 = [partial(F.linear, xs[i % copies], bf16_weights[i % bf16_copies]) for i in order]
        bf16_us = gpu_models.graph_time_us(bf16, replays=REPLAYS)
        bf16_bytes = 2 * n * k + rows * k * 2 + rows * n * 2
        row["bf16_linear_us"] = bf16_us
        row["bf16_fraction_of_copy"] = bf16_bytes / bf16_us * 1e-3 / copy_gb
        # quant_gemv as the engine calls it, against bf16.
        row["kernel_us"] = row[f"{row['quant_gemv_uses']}_us"]
        row["gb_per_s"] = nbytes / row["kernel_us"] * 1e-3
        row["fraction_of_copy"] = row["gb_per_s"] / copy_gb
        row["speedup_vs_bf16"] = bf16_us / row["kernel_us"]
        assert torch.equal(quant_gemv(xs[0], weights[0], qtype),
                           kernels[row["quant_gemv_uses"]](xs[0], weights[0], qtype))
        results.append(row)
    del weights, bf16_weights
    torch.cuda.empty_cache()
    return results


def layout_table() -> list[str]:
    """The CUDA-core kernel's layout per shape on an H200 (132 SMs), and
    the rows of x it takes there (CPU only)."""
    lines = []
    for name, (n, k) in SHAPES.items():
        ctas, warps, slots = gguf_quant._small_layout(n, k, H200_SMS)
        fits = {GGUF_KERNEL_TYPES[q]: max((m for m in range(1, CUDA_CORE_GEMV_MAX_ROWS + 1)
                                           if cuda_core_gemv_fits(m, n, k, q, H200_SMS)), default=0)
                for q in GGUF_KERNEL_TYPES}
        lines.append(f"{name:<13}{ctas:>4} CTAs x {slots:>2} slots x {warps:>2} warps/tile; "
                     f"rows <= {fits}")
    return lines


def bench_prefill(qtype: int, name: str, n: int, k: int, copy_gb: float,
                  generator: torch.Generator) -> list[dict]:
    from tests.perf import gpu_models

    packed_bytes = n * packed_row_bytes(qtype, k)
    copies = copies_for(packed_bytes)
    weights = [random_blocks(qtype, n, k, generator) for _ in range(copies)]
    bf16_weight = torch.randn(n, k, device="cuda", generator=generator).to(BF16)
    scratch = torch.empty(n, k, device="cuda", dtype=BF16)
    calls = 8
    order = [i % copies for i in range(calls)]
    dequant = [partial(dequantize_to, weights[i], qtype, scratch) for i in order]
    dequant_us = gpu_models.graph_time_us(dequant, replays=REPLAYS)
    results = []
    for rows in PREFILL_ROWS:
        x = torch.randn(rows, k, device="cuda", generator=generator).to(BF16)

        def quantized(packed: torch.Tensor, x: torch.Tensor = x) -> None:
            dequantize_to(packed, qtype, scratch)
            F.linear(x, scratch)

        ours_us = gpu_models.graph_time_us([partial(quantized, weights[i]) for i in order],
                                           replays=REPLAYS)
        bf16_us = gpu_models.graph_time_us([partial(F.linear, x, bf16_weight)] * calls,
                                           replays=REPLAYS)
        results.append({
            "type": GGUF_KERNEL_TYPES[qtype], "shape": name, "n": n, "k": k, "rows": rows,
            "dequantize_us": dequant_us,
            "dequantize_gb_per_s": (packed_bytes + 2 * n * k) / dequant_us * 1e-3,
            "dequantize_fraction_of_copy": (packed_bytes + 2 * n * k) / dequant_us * 1e-3 / copy_gb,
            "dequant_linear_us": ours_us, "bf16_linear_us": bf16_us,
            "slowdown_vs_bf16": ours_us / bf16_us,
        })
    del weights
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU only: the tables, no CUDA")
    parser.add_argument("--types", default=",".join(GGUF_KERNEL_TYPES.values()),
                        help="comma-separated type names (default: all)")
    parser.add_argument("--rows", default=",".join(map(str, GEMV_ROWS)),
                        help="comma-separated GEMV row counts (default: %(default)s)")
    parser.add_argument("--shapes", default="",
                        help="only shapes whose name contains this (e.g. 8B)")
    parser.add_argument("--gemv-only", action="store_true", help="skip the prefill timings")
    args = parser.parse_args()
    by_name = {name: qtype for qtype, name in GGUF_KERNEL_TYPES.items()}
    qtypes = [by_name[name] for name in args.types.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = {name: shape for name, shape in SHAPES.items() if args.shapes in name}
    table = byte_table()
    if args.smoke:
        assert max(rows_list) <= QUANT_GEMV_MAX_ROWS < min(PREFILL_ROWS)
        assert all(name in SHAPES for name in PREFILL_SHAPES) and shapes
        for row in table:
            print(f"{row['shape']:<13}{row['type']:<6}{row['packed_bytes']:>12}"
                  f"{row['bits_per_weight']:>6.2f} bits/weight")
        print("\n".join(layout_table()))
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke)")
    from tests.perf import gpu_models

    torch.manual_seed(0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    copy_gb = gpu_models.copy_bandwidth(torch.device("cuda")) * 1e-9
    gemv, prefill = [], []
    for qtype in qtypes:
        for name, (n, k) in shapes.items():
            gemv.extend(bench_gemv(qtype, name, n, k, copy_gb, rows_list, generator))
        if not args.gemv_only:
            for name in PREFILL_SHAPES:
                prefill.extend(bench_prefill(qtype, name, *SHAPES[name], copy_gb, generator))
    print(f"device copy: {copy_gb:.0f} GB/s (read + written) on {torch.cuda.get_device_name()}")
    print("us and % of the copy rate per kernel: CUDA cores, tensor cores, bf16 F.linear")
    print(f"{'type':<6}{'shape':<13}{'N x K':>13}{'M':>3}{'cores us':>10}{'%':>5}{'tc us':>9}"
          f"{'%':>5}{'bf16 us':>9}{'%':>5}{'diff':>9}")
    for row in gemv:
        cores = (f"{row['cuda_cores_us']:>10.2f}{100 * row['cuda_cores_fraction_of_copy']:>5.0f}"
                 if "cuda_cores_us" in row else f"{'-':>10}{'':>5}")
        diff = row.get("cuda_cores_rel_diff_vs_dequantized_linear",
                       row["tensor_cores_rel_diff_vs_dequantized_linear"])
        print(f"{row['type']:<6}{row['shape']:<13}{row['n']:>6} x{row['k']:>6}{row['rows']:>3}"
              f"{cores}{row['tensor_cores_us']:>9.2f}"
              f"{100 * row['tensor_cores_fraction_of_copy']:>5.0f}"
              f"{row['bf16_linear_us']:>9.2f}{100 * row['bf16_fraction_of_copy']:>5.0f}"
              f"{diff:>9.1e}")
    print(f"{'type':<6}{'shape':<13}{'M':>5}{'dequant us':>12}{'GB/s':>7}{'deq+linear us':>15}"
          f"{'bf16 us':>9}{'slowdown':>10}")
    for row in prefill:
        print(f"{row['type']:<6}{row['shape']:<13}{row['rows']:>5}{row['dequantize_us']:>12.1f}"
              f"{row['dequantize_gb_per_s']:>7.0f}{row['dequant_linear_us']:>15.1f}"
              f"{row['bf16_linear_us']:>9.1f}{row['slowdown_vs_bf16']:>9.2f}x")
    out_dir = os.environ.get("OUT")
    if out_dir:
        result = {"device": torch.cuda.get_device_name(), "copy_gb_per_s": copy_gb,
                  "gemv": gemv, "prefill": prefill, "bytes": table}
        (Path(out_dir) / "bench_gguf_quant.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
