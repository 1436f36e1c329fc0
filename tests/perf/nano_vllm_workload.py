"""nano-vllm's offline benchmark as a workload for the engine's own step
loop: 256 requests of random tokens, input and output lengths uniform in
100..1024 (seed 0), all submitted at once, greedy, no stop at EOS; the figure
is output tokens over the whole wall time, prefill included.

bench_gpu_engine.py runs it at the dense Qwen3 shapes, bench_gpu_moe_decode.py
at the Qwen3-30B-A3B shape; their smoke runs pass a few short requests.
"""

from __future__ import annotations

import random
import time
from typing import Any

import protocol as p
from engine.scheduling.core import EngineCore
from tests.perf.gpu_models import QWEN3_TEXT_VOCAB

REQUESTS = 256
LENGTHS = (100, 1024)
# A warm-up request before the clock starts: kernels compiled, graphs warm.
WARM_PROMPT, WARM_OUTPUT = 256, 32

# (prompt tokens, output tokens) per request.
Workload = list[tuple[list[int], int]]


def submit(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int,
           temperature: float = 0.0) -> None:
    params = p.SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    core.handle(p.Generate(request_id, prompt, params))


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(QWEN3_TEXT_VOCAB) for _ in range(length)]


def drain(core: EngineCore) -> None:
    while core.has_work:
        core.step()


def nano_vllm_requests(count: int = REQUESTS, lengths: tuple[int, int] = LENGTHS,
                       seed: int = 0) -> Workload:
    """The requests, lengths drawn first and then the prompts' tokens from
    one generator (the draws every figure since issue 3 was measured with)."""
    rng = random.Random(seed)
    sizes = [(rng.randint(*lengths), rng.randint(*lengths)) for _ in range(count)]
    return [(random_prompt(rng, prompt_len), out_len) for prompt_len, out_len in sizes]


def kv_tokens_needed(workload: Workload, page_size: int) -> int:
    """KV tokens that hold every request's prompt and output at once, each
    request's last page rounded up: no preemption needed."""
    pages = sum(-(-(len(prompt) + out_len) // page_size) for prompt, out_len in workload)
    return pages * page_size


def run_workload(core: EngineCore, workload: Workload) -> dict[str, Any]:
    """Warm up, then submit every request at once and run them to the end."""
    submit(core, "warm", random_prompt(random.Random(0), WARM_PROMPT), WARM_OUTPUT)
    drain(core)
    started = time.perf_counter()
    for index, (prompt, out_len) in enumerate(workload):
        submit(core, f"r{index}", prompt, out_len)
    drain(core)
    seconds = time.perf_counter() - started
    output_tokens = sum(out_len for _, out_len in workload)
    return {"requests": len(workload), "input_tokens": sum(len(prompt) for prompt, _ in workload),
            "output_tokens": output_tokens, "seconds": seconds,
            "output_tok_s": output_tokens / seconds,
            "preemptions": core.scheduler.num_preemptions,
            "kv_pages": core.scheduler.kv.pool.num_pages}
