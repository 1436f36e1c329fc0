"""Qwen2-MoE (routed experts plus a gated shared expert) against transformers.

A tiny random-weight Qwen2MoeForCausalLM saved by transformers, served from
its safetensors and from a GGUF laid out as llama.cpp's convert_hf_to_gguf.py
writes a qwen2moe file: experts stacked per matrix (ffn_*_exps), the shared
expert as ffn_{gate,up,down}_shexp and its gate, squeezed to a vector, as
ffn_gate_inp_shexp. Routing weights are not renormalised (norm_topk_prob
False, as in the released checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

import protocol as p
from engine.execution.device_state import host_resident_tensors
from engine.loader import load_model
from engine.loader.gguf_file import open_gguf
from engine.models import ModelConfig
from engine.models.decoder import MLP
from engine.models.shared_expert_moe import SharedExpertMoE
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.engine.test_engine_exactness import greedy, hf_greedy, make_engine, prompts, run
from tests.engine.test_loaders import add_metadata, assert_same_weights, gguf_name, prefill_logits
from tests.engine.test_moe_gguf import natural_order
from tests.support.fixtures import QWEN3_TOKENIZER_FILES, qwen3_tokenizer
from tests.support.tiny_models import _SMALL

CPU = torch.device("cpu")

# llama.cpp's names for the shared expert, written out independently of the loader.
_SHARED_NAMES = {
    "shared_expert.gate_proj": "ffn_gate_shexp",
    "shared_expert.up_proj": "ffn_up_shexp",
    "shared_expert.down_proj": "ffn_down_shexp",
    "shared_expert_gate": "ffn_gate_inp_shexp",
}


def build_tiny_qwen2_moe(target: Path, dtype: torch.dtype = torch.float32,
                         **overrides: object) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(**{
        **_SMALL, "num_hidden_layers": 4, "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    target.mkdir(parents=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copyfile(qwen3_tokenizer() / name, target / name)
    return target


def write_qwen2moe_gguf(hf_dir: Path, target: Path, squeeze_gate: bool = True,
                        drop: tuple[str, ...] = ()) -> Path:
    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(target, "qwen2moe")
    add_metadata(writer, cfg)
    writer.add_uint32("qwen2moe.expert_count", cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_uint32("qwen2moe.expert_used_count", cfg["num_experts_per_tok"])
    writer.add_uint32("qwen2moe.expert_feed_forward_length", cfg["moe_intermediate_size"])
    writer.add_uint32("qwen2moe.expert_shared_feed_forward_length",
                      cfg["shared_expert_intermediate_size"])
    experts: dict[tuple[str, str], list[np.ndarray]] = {}
    with safe_open(hf_dir / "model.safetensors", framework="np") as handle:
        for name in sorted(handle.keys(), key=natural_order):
            array, parts = handle.get_tensor(name), name.split(".")
            module = ".".join(parts[4:-1])  # under model.layers.N.mlp
            if ".experts." in name:
                matrix = parts[6].removesuffix("_proj")
                experts.setdefault((parts[2], matrix), []).append(array)
                continue
            if name.endswith("mlp.gate.weight"):
                out = f"blk.{parts[2]}.ffn_gate_inp.weight"
            elif module in _SHARED_NAMES:
                out = f"blk.{parts[2]}.{_SHARED_NAMES[module]}.weight"
                if module == "shared_expert_gate" and squeeze_gate:
                    array = array.squeeze(0)
            else:
                out = gguf_name(name)
            if out not in drop:
                writer.add_tensor(out, np.ascontiguousarray(array))
    for (layer, matrix), stack in experts.items():
        writer.add_tensor(f"blk.{layer}.ffn_{matrix}_exps.weight", np.stack(stack))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers, layer 2 dense through mlp_only_layers."""
    return build_tiny_qwen2_moe(tmp_path_factory.mktemp("q2moe") / "mixed", mlp_only_layers=[2])


@pytest.fixture(scope="module")
def all_sparse_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Experts in every layer, as llama.cpp's qwen2moe files have them."""
    return build_tiny_qwen2_moe(tmp_path_factory.mktemp("q2moe") / "all-sparse")


def _reference(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _assert_matches_transformers(hf_dir: Path, served: Path) -> None:
    """Prompt logits of one prefill, and the engine's batched greedy tokens."""
    reference = _reference(hf_dir)
    cases = prompts(hf_dir)
    with torch.inference_mode():
        expected_logits = reference(torch.tensor([cases["long"]])).logits[0].float()
    ours = prefill_logits(load_model(served, CPU, torch.float32).model, cases["long"])
    diff = (ours - expected_logits).abs().max().item()
    assert diff < 1e-4, f"max |logit diff| {diff:.2e}"
    core, events = make_engine(served)
    expected = {name: hf_greedy(reference, prompt) for name, prompt in cases.items()}
    got = run(core, events, {name: (prompt, greedy()) for name, prompt in cases.items()})
    assert got == expected
    core.scheduler.check_invariants()


def test_config_follows_mlp_only_layers_without_renormalising(mixed_dir: Path) -> None:
    loaded = load_model(mixed_dir, CPU, torch.float32)
    moe = loaded.config.moe
    assert moe is not None and moe.sparse_layers == (0, 1, 3)
    assert not moe.normalize_topk and not moe.weigh_in_float32
    assert moe.shared_expert_intermediate_size == 48
    assert loaded.config.attention_bias and not loaded.config.o_proj_bias
    kinds = [type(layer.mlp) for layer in loaded.model.layers]
    assert kinds == [SharedExpertMoE, SharedExpertMoE, MLP, SharedExpertMoE]


def test_safetensors_logits_and_greedy_tokens_match_transformers(mixed_dir: Path) -> None:
    _assert_matches_transformers(mixed_dir, mixed_dir)


def test_gguf_logits_and_greedy_tokens_match_transformers(all_sparse_dir: Path,
                                                          tmp_path: Path) -> None:
    path = write_qwen2moe_gguf(all_sparse_dir, tmp_path / "tiny-qwen2moe.gguf")
    from_gguf = load_model(path, CPU, torch.float32)
    from_hf = load_model(all_sparse_dir, CPU, torch.float32)
    assert from_gguf.config.architecture == "Qwen2MoeForCausalLM"
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=from_hf.config.rms_norm_eps) \
        == from_hf.config
    assert_same_weights(from_gguf.model, from_hf.model)
    _assert_matches_transformers(all_sparse_dir, path)


def test_gguf_shared_gate_kept_as_a_matrix_loads_too(all_sparse_dir: Path,
                                                     tmp_path: Path) -> None:
    path = write_qwen2moe_gguf(all_sparse_dir, tmp_path / "unsqueezed.gguf", squeeze_gate=False)
    assert_same_weights(load_model(path, CPU, torch.float32).model,
                        load_model(all_sparse_dir, CPU, torch.float32).model)


def test_gguf_without_a_shared_expert_tensor_is_refused(all_sparse_dir: Path,
                                                        tmp_path: Path) -> None:
    dropped = "blk.1.ffn_gate_inp_shexp.weight"
    path = write_qwen2moe_gguf(all_sparse_dir, tmp_path / "broken.gguf", drop=(dropped,))
    with pytest.raises(ValueError, match=rf"GGUF layer 1 lacks its experts \({dropped}\)"):
        ModelConfig.from_gguf(open_gguf(path))


def test_host_resident_routed_experts_leave_the_shared_expert_on_the_device(
        mixed_dir: Path) -> None:
    """--expert-residency host moves the routed stacks only (on the CPU the flag
    is all that changes); the shared expert and both gates stay with the rest."""
    model = load_model(mixed_dir, CPU, torch.float32, host_expert_layers=-1).model
    assert set(host_resident_tensors(model)) == {
        f"layers.{layer}.mlp.routed.{weight}" for layer in (0, 1, 3)
        for weight in ("gate_up_weight", "down_weight")}


# ---- the GPU path (bf16, CudaOps, CUDA graphs) ------------------------------------------


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head size 64 and 16 experts, top 4, as the GPU kernels expect; layer 0 dense."""
    return build_tiny_qwen2_moe(
        tmp_path_factory.mktemp("q2moe-gpu") / "m", dtype=torch.bfloat16, hidden_size=256,
        intermediate_size=768, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, shared_expert_intermediate_size=512, mlp_only_layers=[0])


def _gpu_tokens(path: Path, cuda_graph: bool,
                requests: dict[str, list[int]]) -> dict[str, list[int]]:
    core, events = in_process.make_engine(
        path, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=8,
        max_batched_tokens=64, kv_capacity_tokens=16384, cuda_graph=cuda_graph)
    params = p.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for output in step_outputs(run_to_completion(
            core, events, {rid: (ids, params) for rid, ids in requests.items()})):
        tokens[output.request_id].extend(output.token_ids)
    return tokens


@pytest.mark.gpu
def test_gpu_graphs_match_eager_and_first_tokens_are_among_transformers_top5(
        gpu_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = prompts(gpu_model_dir)["long"]
    requests = {f"r{i}": ids[: 20 + 17 * i] for i in range(4)}
    eager = _gpu_tokens(gpu_model_dir, cuda_graph=False, requests=requests)
    graphed = _gpu_tokens(gpu_model_dir, cuda_graph=True, requests=requests)
    assert all(len(t) == 24 for t in eager.values()) and graphed == eager
    # bf16 rounding may part ours from transformers' at a near-tie.
    hf = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        for rid, prompt in requests.items():
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1]
            assert graphed[rid][0] in logits.topk(5).indices.tolist(), rid
