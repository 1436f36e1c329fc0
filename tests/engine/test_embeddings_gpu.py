"""Embeddings on the GPU (bf16, our kernels, CUDA graphs for the generation
beside them) against transformers' float32 hidden states of the same weights,
at Qwen3-0.6B's shape: as close as transformers' own bf16 run is, for last,
mean and CLS pooling, a prompt of many prefill chunks and a batch of mixed
lengths, with a generation running in the same steps."""

from __future__ import annotations

import gc
from array import array
from pathlib import Path

import pytest
import torch

import protocol as p
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.engine.test_gpu_engine import _qwen3_dir

pytestmark = pytest.mark.gpu

POOLINGS = ("last", "mean", "cls")


def _pooled(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling].float()
    return vector / vector.norm()


def test_gpu_embeddings_are_as_close_as_transformers_bf16(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import AutoModel

    path: Path = _qwen3_dir(tmp_path_factory.mktemp("qwen3-0.6b-embed"), hidden_size=1024,
                            intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 3, 17, 64, 200, 1500]  # the last spans six 256-token chunks
    prompts = [torch.randint(1000, 100_000, (n,), generator=generator).tolist() for n in lengths]
    exact_model = AutoModel.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    rough_model = AutoModel.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    expected: dict[tuple[int, str], torch.Tensor] = {}
    bf16_cosine: dict[tuple[int, str], float] = {}
    with torch.inference_mode():
        for index, ids in enumerate(prompts):
            tensor = torch.tensor([ids], device="cuda")
            exact = exact_model(tensor).last_hidden_state[0]
            rough = rough_model(tensor).last_hidden_state[0]
            for pooling in POOLINGS:
                expected[index, pooling] = _pooled(exact, pooling)
                bf16_cosine[index, pooling] = float(
                    _pooled(rough, pooling) @ expected[index, pooling])
    del exact_model, rough_model
    gc.collect()
    torch.cuda.empty_cache()

    core, events = in_process.make_engine(
        path, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=32,
        max_batched_tokens=256, kv_capacity_tokens=32768)
    assert core.runner.graphs is not None
    requests: dict[str, tuple[list[int], p.SamplingParams]] = {
        f"{index}-{pooling}": (ids, p.SamplingParams(max_tokens=0, pooling=pooling))  # type: ignore[arg-type]
        for index, ids in enumerate(prompts) for pooling in POOLINGS}
    requests["gen"] = (prompts[2], p.SamplingParams(max_tokens=40, temperature=0.0,
                                                    ignore_eos=True))
    outputs = step_outputs(run_to_completion(core, events, requests))
    vectors = {o.request_id: torch.tensor(array("f", o.embedding).tolist(), device="cuda")
               for o in outputs if o.embedding}
    assert sum(len(o.token_ids) for o in outputs if o.request_id == "gen") == 40
    for index in range(len(prompts)):
        for pooling in POOLINGS:
            ours = vectors[f"{index}-{pooling}"]
            assert abs(float(ours.norm()) - 1.0) < 1e-4
            cosine = float(ours @ expected[index, pooling])
            # bf16 rounding costs about as much as transformers' own bf16 run.
            assert cosine >= min(0.999, bf16_cosine[index, pooling] - 0.002), (
                index, pooling, cosine, bf16_cosine[index, pooling])
    core.runner.sleep("disk", [])
