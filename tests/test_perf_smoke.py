"""The benchmarks in tests/perf/ still run (pytest does not collect them).

Each CPU benchmark runs in its --smoke mode (a tiny model, one round, a few
seconds) as its own process, as a person would run it; its figures are not
looked at, only that it finishes (bench_gpu_moe_decode.py's JSON is read too:
every section it measures must be in it). The GPU benchmarks and profilers need an
H200-sized GPU and minutes, so here they are only imported (every name they
use from the project must still exist); run them on the GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "tests" / "perf"

# script -> extra arguments for its smoke run
CPU_SCRIPTS = {
    "bench_cpu.py": ["--threads", "2"],
    "bench_embeddings.py": [],
    "bench_gated_delta_prefill.py": [],
    "bench_gpu_draft_model.py": [],
    "bench_gpu_hybrid.py": [],
    "bench_gpu_kv_tiers.py": [],
    "bench_gpu_moe.py": [],
    "bench_gpu_scores.py": [],
    "bench_gpu_speculation.py": [],
    "bench_gpu_vision.py": ["--arch", "qwen2_5_vl,qwen3_vl"],
    "bench_gguf_quant.py": [],
    "bench_gpu_quant.py": [],
    "bench_lifecycle.py": [],
    "bench_models_on_gpu.py": [],
    "bench_router_streaming.py": [],
    "bench_speculation_cpu.py": ["--threads", "2"],
    "bench_waiting_memory.py": [],
    "probe_disk_writers.py": [],
}
GPU_ONLY = [
    "agent_workload.py", "bench_decode_attention.py", "bench_gpu_engine.py", "bench_gpu_http.py",
    "bench_moe_grouped.py", "bench_prefill_attention.py", "bench_sampling.py", "bench_skinny_gemm.py",
    "bench_small_ops.py", "gpu_models.py", "nano_vllm_workload.py", "probe_pdl.py",
    "profile_decode_kernels.py", "profile_decode_step.py", "profile_hybrid_decode.py",
    "profile_mixed_step.py", "profile_throughput.py", "vision_shapes.py",
]
# Smoked by tests of their own below, which read the JSON they write.
CHECKED_SCRIPTS = ["bench_gpu_moe_decode.py"]


def test_every_script_is_smoked_or_imported() -> None:
    assert {p.name for p in PERF.glob("*.py")} == \
        set(CPU_SCRIPTS) | set(GPU_ONLY) | set(CHECKED_SCRIPTS)


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("script", sorted(CPU_SCRIPTS))
def test_cpu_benchmark_smoke(script: str, tiny_qwen3_dir: Path) -> None:
    extra = list(CPU_SCRIPTS[script])
    if script in ("bench_cpu.py", "bench_router_streaming.py", "bench_waiting_memory.py"):
        extra += ["--model", str(tiny_qwen3_dir)]  # built once for the session
    run([str(PERF / script), "--smoke", *extra], timeout=180)


def test_moe_decode_smoke_measures_every_figure_of_issue_17(tmp_path: Path) -> None:
    run([str(PERF / "bench_gpu_moe_decode.py"), "--smoke"], timeout=180,
        env={"OUT": str(tmp_path)})
    results = json.loads((tmp_path / "bench_gpu_moe_decode.json").read_text())
    assert [(row["config"], row["batch"]) for row in results["rows"]] == [("device", 1), ("device", 2)]
    # nano-vllm's workload, a few short requests of it, through the engine.
    workload = results["workload"]
    assert workload["requests"] == 4 and workload["preemptions"] == 0
    assert workload["output_tokens"] > 0 and workload["output_tok_s"] > 0
    # transformers' model of the same tiny config, and ours over it.
    hf = results["transformers"]
    assert hf["available"] and hf["same_params"] and hf["decode_tok_s"] > 0
    assert hf["ours_over_transformers"] == pytest.approx(results["rows"][0]["tok_s"]
                                                         / hf["decode_tok_s"])


def test_gpu_benchmarks_import() -> None:
    # One process for all of them: torch is imported once.
    imports = "; ".join(f"import tests.perf.{Path(name).stem}" for name in GPU_ONLY)
    run(["-c", imports], timeout=120)


def test_the_gc_probe_logs_a_long_collection(tmp_path: Path) -> None:
    # A heap of a million lists makes a full collection take well over 1 ms.
    env = {**os.environ, "PYTHONPATH": f"{PERF / 'gc_probe'}{os.pathsep}{ROOT}",
           "ROUNDHOUSE_GC_PROBE": str(tmp_path / "gc")}
    code = "import gc; heap = [[i] for i in range(1_000_000)]; gc.collect()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    (log,) = (tmp_path / "gc").glob("gc-*.jsonl")
    assert any('"generation": 2' in line for line in log.read_text().splitlines())
