"""A mixture-of-experts model through the GPU path (bf16, CudaOps, CUDA graphs).

No expert kernels exist yet: the experts run through torch on the device, the
per-expert loop when eager and the dense, zero-weighted form inside graph
captures (engine/execution/model_ops.py). These tests check that path works:
graphs on give the tokens of graphs off, and the first tokens are among
transformers' best.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.support import fixtures

pytestmark = pytest.mark.gpu

TEXT = ("Roundhouses, circular buildings with a turntable at their centre, let engineers store "
        "and service many locomotives in a small yard. ")


@pytest.fixture(scope="module")
def qwen3_moe_gpu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    target = tmp_path_factory.mktemp("qwen3-moe-gpu")
    config = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
        mlp_only_layers=[0], max_position_embeddings=4096, rope_theta=1_000_000.0,
        initializer_range=0.1, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    source = fixtures.qwen3_tokenizer()
    for name in fixtures.QWEN3_TOKENIZER_FILES:
        (target / name).write_bytes((source / name).read_bytes())
    return target


def _tokens(path: Path, cuda_graph: bool, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    core, events = in_process.make_engine(
        path, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=8,
        max_batched_tokens=64, kv_capacity_tokens=16384, cuda_graph=cuda_graph)
    params = p.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = step_outputs(run_to_completion(core, events, {rid: (ids, params)
                                                            for rid, ids in prompts.items()}))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for output in outputs:
        tokens[output.request_id].extend(output.token_ids)
    return tokens


def test_graphs_on_give_the_tokens_of_graphs_off(qwen3_moe_gpu: Path) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(qwen3_moe_gpu)(TEXT * 3)["input_ids"]
    prompts = {f"r{i}": ids[: 20 + 17 * i] for i in range(5)}
    eager = _tokens(qwen3_moe_gpu, cuda_graph=False, prompts=prompts)
    graphed = _tokens(qwen3_moe_gpu, cuda_graph=True, prompts=prompts)
    assert all(len(t) == 24 for t in eager.values())
    assert graphed == eager


def test_first_tokens_among_transformers_top5(qwen3_moe_gpu: Path) -> None:
    """bf16 rounding may part ours from transformers' at a near-tie, so each
    prompt's first token must be among transformers' five best (bf16, GPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(qwen3_moe_gpu)(TEXT * 3)["input_ids"]
    prompts = {f"r{i}": ids[: 20 + 17 * i] for i in range(5)}
    ours = _tokens(qwen3_moe_gpu, cuda_graph=True, prompts=prompts)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_moe_gpu, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        for rid, prompt in prompts.items():
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1]
            assert ours[rid][0] in logits.topk(5).indices.tolist(), rid
