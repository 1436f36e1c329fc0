"""Mixture-of-experts GGUF files (Qwen3-MoE, Mixtral) laid out as llama.cpp's
convert_hf_to_gguf.py writes them, against the Hugging Face checkpoint they
came from and against transformers.

qwen3moe files carry {arch}.expert_* keys and each layer's experts stacked per
matrix (ffn_gate_exps/ffn_up_exps [E, I, H], ffn_down_exps [E, H, I]) beside
the router ffn_gate_inp [E, H]; Mixtral is a "llama" file with
llama.expert_count, the same stacked tensors and Llama's q/k row permutation
(old Mixtral files list each expert's matrices as ffn_gate.E instead).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors import safe_open

from engine.loader import load_model
from engine.loader.gguf_file import open_gguf
from engine.models import ModelConfig
from tests.engine.test_engine_exactness import greedy, hf_greedy, make_engine, prompts, run
from tests.engine.test_loaders import (
    add_metadata,
    assert_same_weights,
    gguf_name,
    llama_cpp_permute,
    prefill_logits,
)

CPU = torch.device("cpu")
Q8_0 = gguf.GGMLQuantizationType.Q8_0

# HF architecture -> (GGUF architecture, the tiny checkpoint, HF expert names
# gate/up/down under the layer's sparse block, that block's name).
_LAYOUTS = {
    "qwen3_moe": ("qwen3moe", "qwen3_moe_all_sparse", ("gate_proj", "up_proj", "down_proj"), "mlp"),
    "mixtral": ("llama", "mixtral", ("w1", "w3", "w2"), "block_sparse_moe"),
}


@dataclasses.dataclass
class Conversion:
    """How to write the file: all tensors present, or some left out or broken."""

    quantized: bool = False  # Q8_0 matrices, as `--outtype q8_0` writes them
    per_expert: bool = False  # old Mixtral files: blk.N.ffn_gate.E.weight
    drop: tuple[str, ...] = ()  # GGUF tensor names left out
    metadata: dict[str, int | bool] = dataclasses.field(default_factory=dict)  # keys overridden


def write_moe_gguf(hf_dir: Path, target: Path, which: str,
                   conversion: Conversion | None = None) -> Path:
    conversion = conversion or Conversion()
    arch, _, matrices, block = _LAYOUTS[which]
    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(target, arch)
    add_metadata(writer, cfg)
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    keys = {"expert_count": num_experts, "expert_used_count": cfg["num_experts_per_tok"]}
    if arch == "qwen3moe":
        keys["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    for key, value in {**keys, **conversion.metadata}.items():
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)

    def add(name: str, array: np.ndarray) -> None:
        if name in conversion.drop:
            return
        # llama.cpp keeps norms and the router in F32 whatever the outtype.
        if conversion.quantized and array.ndim >= 2 and "ffn_gate_inp" not in name:
            writer.add_tensor(name, quantize(array, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))

    with safe_open(hf_dir / "model.safetensors", framework="np") as handle:
        experts: dict[tuple[int, str], list[np.ndarray]] = {}
        for name in sorted(handle.keys(), key=natural_order):
            array = handle.get_tensor(name)
            parts = name.split(".")
            if ".experts." in name:
                layer, expert, matrix = int(parts[2]), int(parts[5]), parts[6]
                kind = ("gate", "up", "down")[matrices.index(matrix)]
                if conversion.per_expert:
                    add(f"blk.{layer}.ffn_{kind}.{expert}.weight", array)
                else:
                    experts.setdefault((layer, kind), []).append(array)
            elif name.endswith(f"{block}.gate.weight"):
                add(f"blk.{parts[2]}.ffn_gate_inp.weight", array)
            else:
                if arch == "llama" and ".q_proj." in name:
                    array = llama_cpp_permute(array, cfg["num_attention_heads"])
                elif arch == "llama" and ".k_proj." in name:
                    array = llama_cpp_permute(array, cfg["num_key_value_heads"])
                add(gguf_name(name), array)
        for (layer, kind), stack in experts.items():
            # The converter stacks experts 0..E-1 of one matrix: [E, rows, cols].
            add(f"blk.{layer}.ffn_{kind}_exps.weight", np.stack(stack))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def natural_order(name: str) -> list[object]:
    # Experts in numeric order (10 after 9), so stacks come out 0..E-1.
    return [int(part) if part.isdigit() else part for part in name.split(".")]


@pytest.fixture(scope="module", params=list(_LAYOUTS))
def which(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_dir(which: str, tiny_model_factory) -> Path:
    return tiny_model_factory(_LAYOUTS[which][1])


@pytest.fixture(scope="module")
def gguf_file(which: str, hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_moe_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / f"tiny-{which}.gguf", which)


def _q8_roundtrip(tensor: torch.Tensor) -> torch.Tensor:
    array = tensor.numpy()
    return torch.from_numpy(dequantize(quantize(array, Q8_0), Q8_0).reshape(array.shape))


def test_config_and_weights_match_the_hf_checkpoint(which: str, hf_dir: Path,
                                                    gguf_file: Path) -> None:
    from_gguf = load_model(gguf_file, CPU, torch.float32)
    from_hf = load_model(hf_dir, CPU, torch.float32)
    hf_config = from_hf.config
    assert from_gguf.config.moe is not None and from_gguf.config.moe == hf_config.moe
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=hf_config.rms_norm_eps) == hf_config
    # Every expert of every layer where the HF checkpoint has it (q/k unpermuted for Mixtral).
    assert_same_weights(from_gguf.model, from_hf.model)


def test_logits_and_engine_greedy_tokens_match_transformers(which: str, hf_dir: Path,
                                                            gguf_file: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cases = prompts(hf_dir)  # rendered with the HF directory's tokenizer
    ids = cases["long"]
    with torch.inference_mode():
        expected_logits = reference(torch.tensor([ids])).logits[0].float()
    ours = prefill_logits(load_model(gguf_file, CPU, torch.float32).model, ids)
    diff = (ours - expected_logits).abs().max().item()
    assert diff < 1e-4, f"{which}: max |logit diff| {diff:.2e}"

    core, events = make_engine(gguf_file)
    expected = {name: hf_greedy(reference, prompt) for name, prompt in cases.items()}
    got = run(core, events, {name: (prompt, greedy()) for name, prompt in cases.items()})
    assert got == expected


def test_q8_0_experts_dequantize_in_place(which: str, hf_dir: Path, tmp_path: Path) -> None:
    path = write_moe_gguf(hf_dir, tmp_path / "q8.gguf", which, Conversion(quantized=True))
    from_gguf = load_model(path, CPU, torch.float32)
    from_hf = load_model(hf_dir, CPU, torch.float32)
    router_or_norm = {name for name, t in from_hf.model.weight_destinations().items()
                      if t.dim() == 1 or name.endswith((".mlp.gate.weight",
                                                        "block_sparse_moe.gate.weight"))}
    expected = from_hf.model.weight_destinations()
    for name, tensor in from_gguf.model.weight_destinations().items():
        reference = expected[name]
        if name not in router_or_norm:
            # Q8_0 blocks run along a row; q/k rows were permuted whole, so the
            # round trip commutes with the permutation.
            reference = _q8_roundtrip(reference.contiguous())
        assert torch.equal(tensor, reference), f"{name} differs"


def test_old_mixtral_files_with_one_tensor_per_expert(tiny_model_factory, tmp_path: Path) -> None:
    hf_dir = tiny_model_factory("mixtral")
    path = write_moe_gguf(hf_dir, tmp_path / "old.gguf", "mixtral", Conversion(per_expert=True))
    loaded = load_model(path, CPU, torch.float32)
    assert loaded.config.architecture == "MixtralForCausalLM"
    assert_same_weights(loaded.model, load_model(hf_dir, CPU, torch.float32).model)


def test_llama_file_resolves_by_its_expert_count(tiny_model_factory, tmp_path: Path) -> None:
    path = write_moe_gguf(tiny_model_factory("mixtral"), tmp_path / "m.gguf", "mixtral")
    config = ModelConfig.from_gguf(open_gguf(path))
    assert config.architecture == "MixtralForCausalLM" and config.moe is not None
    assert (config.moe.num_experts, config.moe.experts_per_token) == (4, 2)
    assert config.moe.normalize_topk and config.moe.weigh_in_float32
    assert config.moe.sparse_layers == (0, 1)


def test_qwen3moe_renormalises_unless_the_file_says_not(tiny_model_factory,
                                                        tmp_path: Path) -> None:
    """convert_hf_to_gguf.py writes no norm_topk_prob for qwen3moe, and
    llama.cpp's graph renormalises; qwen3moe.expert_weights_norm overrides."""
    hf_dir = tiny_model_factory("qwen3_moe_all_sparse")
    plain = write_moe_gguf(hf_dir, tmp_path / "plain.gguf", "qwen3_moe")
    raw = write_moe_gguf(hf_dir, tmp_path / "raw.gguf", "qwen3_moe",
                         Conversion(metadata={"expert_weights_norm": False}))
    moe = ModelConfig.from_gguf(open_gguf(plain)).moe
    assert moe is not None and moe.normalize_topk and not moe.weigh_in_float32
    moe = ModelConfig.from_gguf(open_gguf(raw)).moe
    assert moe is not None and not moe.normalize_topk


# -- malformed files --------------------------------------------------------------------


def test_layers_without_experts_are_refused(tiny_model_factory, tmp_path: Path) -> None:
    """The tiny Qwen3-MoE with dense layers 0, 2, 3, 4 cannot be a qwen3moe file:
    llama.cpp makes every layer sparse, so the first dense layer is named."""
    path = write_moe_gguf(tiny_model_factory("qwen3_moe"), tmp_path / "mixed.gguf", "qwen3_moe")
    with pytest.raises(ValueError, match=r"GGUF layer 0 lacks its experts \(blk\.0\.ffn_gate_inp"):
        load_model(path, CPU, torch.float32)


@pytest.mark.parametrize("dropped", ["blk.1.ffn_up_exps.weight", "blk.2.ffn_gate_inp.weight"])
def test_missing_expert_tensor_is_named(dropped: str, tiny_model_factory, tmp_path: Path) -> None:
    hf_dir = tiny_model_factory("qwen3_moe_all_sparse")
    path = write_moe_gguf(hf_dir, tmp_path / "broken.gguf", "qwen3_moe", Conversion(drop=(dropped,)))
    layer = dropped.split(".")[1]
    with pytest.raises(ValueError, match=rf"GGUF layer {layer} lacks its experts \({dropped}\)"):
        load_model(path, CPU, torch.float32)


def test_more_experts_per_token_than_experts_is_refused(tiny_model_factory, tmp_path: Path) -> None:
    hf_dir = tiny_model_factory("mixtral")
    path = write_moe_gguf(hf_dir, tmp_path / "k.gguf", "mixtral",
                          Conversion(metadata={"expert_used_count": 5}))
    with pytest.raises(ValueError, match="5 experts per token with 4 experts"):
        load_model(path, CPU, torch.float32)


def test_qwen3moe_file_without_experts_is_refused(tiny_model_factory, tmp_path: Path) -> None:
    hf_dir = tiny_model_factory("qwen3_moe_all_sparse")
    path = write_moe_gguf(hf_dir, tmp_path / "none.gguf", "qwen3_moe",
                          Conversion(metadata={"expert_count": 0}))
    with pytest.raises(ValueError, match="'qwen3moe' without experts is not supported"):
        load_model(path, CPU, torch.float32)


@pytest.mark.gpu
def test_stacked_experts_land_on_the_gpu_in_one_copy_each(which: str, hf_dir: Path,
                                                          gguf_file: Path) -> None:
    """On the device, in bfloat16: the strided copy of a float32 stack into the
    gate or up half of gate_up gives what the per-expert HF copies give."""
    cuda = torch.device("cuda")
    from_gguf = load_model(gguf_file, cuda, torch.bfloat16)
    from_hf = load_model(hf_dir, cuda, torch.bfloat16)
    assert_same_weights(from_gguf.model, from_hf.model)
