"""Qwen3-Next and Qwen3.5 from GGUF files laid out as llama.cpp's converter writes them.

Tiny random transformers models (Qwen3-Next with routed experts and a shared
expert in every layer, as llama.cpp's qwen3next graph has them; Qwen3.5
dense) are written as float32 GGUF files by convert_to_llama_cpp below, which
restates from llama.cpp's convert_hf_to_gguf.py (Qwen3NextModel and its
Qwen3.5 subclasses) what the converter does beyond renaming:

- zero-centred norm weights (every RMSNorm but linear_attn.norm) + 1;
- A_log -> ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias; conv1d squeezed to [C, K];
- Qwen3-Next: in_proj_qkvz (q, k, v, z per key head) split into attn_qkv
  (all q | all k | all v) and attn_gate (all z); in_proj_ba -> ssm_ba as is;
- Qwen3.5: in_proj_qkv/z/b/a -> attn_qkv / attn_gate / ssm_beta / ssm_alpha,
  every per-value-head axis reordered from grouped by key head to tiled;
- post_attention_layernorm -> post_attention_norm; experts stacked (ffn_*_exps),
  the shared expert as ffn_*_shexp and its gate squeezed to a vector;
- metadata: ssm.{conv_kernel, state_size (key head dim), group_count (key
  heads), time_step_rank (value heads), inner_size (value heads x dim)},
  full_attention_interval, rope.dimension_count (rotated dims per head);
  Qwen3.5's MTP head as extra blocks counted by nextn_predict_layers.

Our loader must give exactly the weights the safetensors checkpoint gives,
and the same logits and greedy tokens as transformers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader import load_model
from engine.models.config import ModelConfig
from engine.models.qwen3_next import (
    HybridCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)
from tests.engine.test_hybrid_models import (
    _COMMON,
    NEW_TOKENS,
    TOL,
    HybridRunner,
    _fill,
    _hf_logits,
    _max_diff,
    _prompt,
)
from tests.engine.test_loaders import add_metadata
from tests.engine.test_moe_gguf import natural_order

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
# family -> (GGUF architecture, our class)
_FAMILIES: dict[str, tuple[str, type[HybridCausalLM]]] = {
    "qwen3_next": ("qwen3next", Qwen3NextForCausalLM),
    "qwen3_5": ("qwen35", Qwen3_5ForCausalLM),
    "qwen3_5_moe": ("qwen35moe", Qwen3_5MoeForCausalLM),
}
# llama.cpp's names for the HF modules (tensor_mapping.py), written out
# independently of the loader's table.
_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def build_hf_model(family: str, directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {**_COMMON, "bos_token_id": 1, "eos_token_id": 2}
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers import Qwen3NextForCausalLM as HFModel

        config = Qwen3NextConfig(
            **common, num_hidden_layers=4, full_attention_interval=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            norm_topk_prob=True)
    elif family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeForCausalLM as HFModel,
        )

        common.pop("intermediate_size")  # every layer is sparse: the config has none
        config = Qwen3_5MoeTextConfig(
            **common, num_hidden_layers=4, full_attention_interval=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        from transformers.models.qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM as HFModel

        config = Qwen3_5TextConfig(**common, num_hidden_layers=3, full_attention_interval=3)
    model = HFModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Zero-centred norms start at 0 and dt_bias at 1: vary them so a
            # missed "+ 1" or a head reorder shows.
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                param.add_(torch.randn(param.shape) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _tiled(rows: np.ndarray, key_heads: int, head_dim: int) -> np.ndarray:
    """Value heads grouped by key head -> tiled (the converter's reorder)."""
    grouped = rows.reshape(key_heads, -1, head_dim, *rows.shape[1:])
    return grouped.swapaxes(0, 1).reshape(rows.shape)


def convert_to_llama_cpp(hf_dir: Path, target: Path, arch: str, mtp_blocks: int = 0,
                         drop: tuple[str, ...] = (), mtp_head: Path | None = None) -> Path:
    """What convert_hf_to_gguf.py writes for the checkpoint in hf_dir (float32):
    mtp_blocks extra MTP blocks as Qwen3.5's converter appends them (a few
    random tensors of one), or the MTP head in the safetensors file mtp_head
    (mtp.*) as block num_hidden_layers: its layer's tensors named as a
    block's, mtp.fc as nextn.eh_proj and its norms (+ 1, as every
    zero-centred norm) as nextn.enorm / hnorm / shared_head_norm; and the
    GGUF tensors named in drop left out."""
    mtp_blocks = 1 if mtp_head is not None else mtp_blocks
    cfg = json.loads((hf_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    key_heads, value_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key_dim, value_dim = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    writer = gguf.GGUFWriter(target, arch)
    # An all-experts model has no dense MLP size: the expert's stands in.
    add_metadata(writer, {"intermediate_size": cfg.get("moe_intermediate_size"), **cfg,
                          "num_hidden_layers": layers + mtp_blocks})
    if mtp_blocks:
        writer.add_uint32(f"{arch}.nextn_predict_layers", mtp_blocks)
    writer.add_uint32(f"{arch}.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    writer.add_uint32(f"{arch}.ssm.state_size", key_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", value_dim * value_heads)
    # transformers saves layer_types (every interval-th layer full attention).
    interval = cfg["layer_types"].index("full_attention") + 1
    writer.add_uint32(f"{arch}.full_attention_interval", interval)
    rotary = cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]
    writer.add_uint32(f"{arch}.rope.dimension_count", int(rotary))
    if cfg.get("num_experts"):
        writer.add_uint32(f"{arch}.expert_count", cfg["num_experts"])
        writer.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
        writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length",
                          cfg["shared_expert_intermediate_size"])
    tiled = arch != "qwen3next" and key_heads != value_heads

    def add(name: str, array: np.ndarray) -> None:
        if name not in drop:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    experts: dict[tuple[str, str], list[np.ndarray]] = {}
    for name, array in _checkpoint_tensors(hf_dir / "model.safetensors", mtp_head, layers):
        top = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
        if name in top:
            add(top[name], array + 1 if name == "model.norm.weight" else array)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        blk = f"blk.{layer}"
        if ".experts." in name:  # mlp.experts.<e>.<matrix>
            experts.setdefault((layer, module.split(".")[-1]), []).append(array)
            continue
        if suffix == "A_log":
            a = -np.exp(array)
            add(f"{blk}.ssm_a", _tiled(a, key_heads, 1) if tiled else a)
            continue
        if suffix == "dt_bias":
            add(f"{blk}.ssm_dt.bias", _tiled(array, key_heads, 1) if tiled else array)
            continue
        if module.endswith("norm") and module != "linear_attn.norm":
            array = array + 1
        if module == "linear_attn.in_proj_qkvz":
            per_head = array.reshape(key_heads, -1, array.shape[-1])
            v_size = value_heads // key_heads * value_dim
            q, k, v, z = np.split(per_head, np.cumsum([key_dim, key_dim, v_size]), axis=1)
            flat = [part.reshape(-1, array.shape[-1]) for part in (q, k, v, z)]
            add(f"{blk}.attn_qkv.weight", np.concatenate(flat[:3]))
            add(f"{blk}.attn_gate.weight", flat[3])
            continue
        if module == "linear_attn.conv1d":
            array = array.squeeze(1)
        if tiled and module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
            qk = 2 * key_heads * key_dim
            array = np.concatenate([array[:qk], _tiled(array[qk:], key_heads, value_dim)])
        elif tiled and module == "linear_attn.in_proj_z":
            array = _tiled(array, key_heads, value_dim)
        elif tiled and module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
            array = _tiled(array, key_heads, 1)
        elif tiled and module == "linear_attn.out_proj":
            array = _tiled(array.T, key_heads, value_dim).T
        elif module == "mlp.shared_expert_gate":
            array = array[0]
        add(f"{blk}.{_NAMES[module]}.{suffix}", array)
    for (layer, matrix), stack in experts.items():
        kind = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}[matrix]
        add(f"blk.{layer}.ffn_{kind}_exps.weight", np.stack(stack))
    if mtp_head is not None:
        with safe_open(mtp_head, framework="np") as handle:
            for name, (gguf_name, plus_one) in _MTP_NAMES.items():
                array = handle.get_tensor(name)
                add(f"blk.{layers}.{gguf_name}", array + 1 if plus_one else array)
    hidden = cfg["hidden_size"]
    rng = np.random.default_rng(0)
    for block in range(layers, layers + mtp_blocks if mtp_head is None else 0):
        add(f"blk.{block}.nextn.eh_proj.weight", rng.standard_normal((hidden, 2 * hidden)))
        add(f"blk.{block}.nextn.enorm.weight", np.ones(hidden))
        add(f"blk.{block}.attn_norm.weight", np.ones(hidden))
        add(f"blk.{block}.ssm_a", -np.ones(value_heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


# The MTP head's own tensors: GGUF name, and whether stored + 1.
_MTP_NAMES = {"mtp.fc.weight": ("nextn.eh_proj.weight", False),
              "mtp.pre_fc_norm_embedding.weight": ("nextn.enorm.weight", True),
              "mtp.pre_fc_norm_hidden.weight": ("nextn.hnorm.weight", True),
              "mtp.norm.weight": ("nextn.shared_head_norm.weight", True)}


def _checkpoint_tensors(model_file: Path, mtp_head: Path | None, layers: int
                        ) -> Iterator[tuple[str, np.ndarray]]:
    """The model's tensors in the converter's order, then the MTP head's
    layer as layer `layers` (the head's own tensors are written by the caller)."""
    with safe_open(model_file, framework="np") as handle:
        for name in sorted(handle.keys(), key=natural_order):
            yield name, handle.get_tensor(name)
    if mtp_head is None:
        return
    with safe_open(mtp_head, framework="np") as handle:
        for name in sorted(handle.keys(), key=natural_order):
            if name.startswith("mtp.layers.0."):
                yield f"model.layers.{layers}." + name.removeprefix("mtp.layers.0."), \
                    handle.get_tensor(name)


@pytest.fixture(scope="module", params=list(_FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def converted(family: str, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, Path, torch.nn.Module]:
    """(HF directory, its GGUF, transformers' model)."""
    hf_dir = tmp_path_factory.mktemp(family)
    hf = build_hf_model(family, hf_dir)
    arch = _FAMILIES[family][0]
    gguf_path = convert_to_llama_cpp(hf_dir, hf_dir.parent / f"{family}.gguf", arch)
    return hf_dir, gguf_path, hf


def _from_safetensors(hf_dir: Path, cls: type[HybridCausalLM]) -> HybridCausalLM:
    cfg = json.loads((hf_dir / "config.json").read_text())
    model = cls(ModelConfig.from_hf_config(cfg, model_cls=cls), "cpu", torch.float32)
    _fill(model, hf_dir)
    return model


def test_config_equals_the_hf_configs(family: str, converted) -> None:
    hf_dir, gguf_path, _ = converted
    cls = _FAMILIES[family][1]
    from_gguf = load_model(gguf_path, CPU, torch.float32).config
    from_hf = ModelConfig.from_hf_config(json.loads((hf_dir / "config.json").read_text()),
                                         model_cls=cls)
    # GGUF keeps the epsilon as a float32.
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-7)
    assert dataclasses.replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps) == from_hf
    assert from_gguf.rotary_dim == 4 and from_gguf.linear_attention is not None


def test_weights_equal_the_safetensors_checkpoints(family: str, converted) -> None:
    """Every slot as the HF checkpoint fills it, bit for bit, but: a
    zero-centred norm's w comes back as (w + 1) - 1, and the model's 1 + w
    is bit for bit; A_log comes back through log(exp(.)) within a rounding."""
    hf_dir, gguf_path, _ = converted
    ours = load_model(gguf_path, CPU, torch.float32).model
    expected = _from_safetensors(hf_dir, _FAMILIES[family][1]).weight_destinations()
    got = ours.weight_destinations()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        if name.endswith("A_log"):
            torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=0)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            assert torch.equal(1 + tensor, 1 + expected[name]), name
        else:
            assert torch.equal(tensor, expected[name]), name


def test_logits_and_greedy_tokens_match_transformers(converted) -> None:
    _, gguf_path, hf = converted
    ours = load_model(gguf_path, CPU, torch.float32).model
    prompt = _prompt(3)
    runner = HybridRunner(ours)
    prefill = torch.cat([runner.logits([(0, prompt[:11])]), runner.logits([(0, prompt[11:])])])
    diff = _max_diff(prefill, _hf_logits(hf, prompt))
    assert diff < TOL, f"max |logit diff| {diff:.2e}"
    tokens = [int(prefill[-1].argmax())]
    while len(tokens) < NEW_TOKENS:
        tokens.append(int(runner.logits([(0, tokens[-1:])])[-1].argmax()))
    expected: list[int] = []
    while len(expected) < NEW_TOKENS:
        expected.append(int(_hf_logits(hf, prompt + expected)[-1].argmax()))
    assert tokens == expected


def test_mtp_blocks_are_skipped_with_a_log_line(family: str, converted,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Qwen3.5's converter appends the MTP head as block num_hidden_layers
    (nextn_predict_layers 1); the text model is the blocks before it."""
    hf_dir, _, _ = converted
    cfg = json.loads((hf_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    arch = _FAMILIES[family][0]
    path = convert_to_llama_cpp(hf_dir, hf_dir / "with-mtp.gguf", arch, mtp_blocks=1)
    with caplog.at_level(logging.INFO, logger="engine.loader.gguf_hybrid"):
        loaded = load_model(path, CPU, torch.float32)
    assert loaded.config.num_layers == layers
    assert f"blk.{layers}" in caplog.text and "MTP" in caplog.text


def test_a_linear_attention_layer_without_its_gate_is_refused(tmp_path: Path) -> None:
    """Qwen3-Next's in_proj_qkvz needs both attn_qkv and attn_gate."""
    hf_dir = tmp_path / "hf"
    build_hf_model("qwen3_next", hf_dir)
    path = convert_to_llama_cpp(hf_dir, tmp_path / "broken.gguf", "qwen3next",
                                drop=("blk.2.attn_gate.weight",))
    with pytest.raises(ValueError, match=r"blk\.2\.attn_qkv"):
        load_model(path, CPU, torch.float32)


def test_the_routers_estimate_reads_the_hybrid_gguf_as_the_engine_loads_it(
        family: str, converted) -> None:
    """router/footprint.py plans a hybrid GGUF's KV as the engine allocates
    it (full-attention layers' pages plus a state row per lane and per
    checkpoint), and leaves out MTP blocks, which the loader skips."""
    from protocol import EngineOptions
    from router.footprint import estimate_footprint, read_shape
    from tests.engine import in_process

    hf_dir, gguf_path, _ = converted
    options = EngineOptions(max_concurrency=2, max_context=128, ctx_checkpoints=1)
    estimate = estimate_footprint(read_shape(gguf_path, "gguf"), options, cuda=False)
    core, _ = in_process.make_engine(gguf_path, max_concurrency=2, max_context=128,
                                     ctx_checkpoints=1)
    pools = core.runner.state_pools
    assert pools is not None
    kv_pages = sum(t.numel() * t.element_size() for pair in core.runner.kv_caches for t in pair)
    assert estimate.kv_bytes == kv_pages + pools.nbytes
    with_mtp = convert_to_llama_cpp(hf_dir, hf_dir / "estimate-mtp.gguf", _FAMILIES[family][0],
                                    mtp_blocks=1)
    assert estimate_footprint(read_shape(with_mtp, "gguf"), options, cuda=False) == estimate


def _write_mtp_head(hf_dir: Path) -> Path:
    """A random MTP head for the checkpoint in hf_dir: its layer a copy of the
    last full-attention layer's tensors, fc and norms random; the config
    says it has one (Qwen3-Next's and Qwen3.5's keys)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    source = max(i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention")
    prefix = f"model.layers.{source}."
    generator = torch.Generator().manual_seed(5)
    hidden = cfg["hidden_size"]
    with safe_open(hf_dir / "model.safetensors", framework="pt") as handle:
        tensors = {"mtp.layers.0." + name.removeprefix(prefix): handle.get_tensor(name)
                   for name in handle.keys() if name.startswith(prefix)}
    tensors["mtp.fc.weight"] = torch.randn((hidden, 2 * hidden), generator=generator)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.randn(hidden, generator=generator) * 0.2
    head = hf_dir / "mtp.safetensors"
    save_file(tensors, head)
    cfg["num_nextn_predict_layers"] = cfg["mtp_num_hidden_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    return head


def test_the_mtp_head_loads_from_gguf_as_from_safetensors(family: str, converted,
                                                          tmp_path: Path) -> None:
    """--spec mtp reads the head from llama.cpp's extra block: every mtp.*
    slot as the safetensors checkpoint fills it (norms as 1 + w, stored w + 1)."""
    hf_dir, _, _ = converted
    directory = tmp_path / "hf"
    shutil.copytree(hf_dir, directory)
    head = _write_mtp_head(directory)
    arch = _FAMILIES[family][0]
    gguf_path = convert_to_llama_cpp(directory, tmp_path / "mtp.gguf", arch, mtp_head=head)
    from_gguf = load_model(gguf_path, CPU, torch.float32, with_mtp=True).model
    from_hf = load_model(directory, CPU, torch.float32, with_mtp=True).model
    assert from_gguf.config.mtp_layers == from_hf.config.mtp_layers == 1
    got = {k: v for k, v in from_gguf.weight_destinations().items() if k.startswith("mtp.")}
    expected = {k: v for k, v in from_hf.weight_destinations().items() if k.startswith("mtp.")}
    assert got.keys() == expected.keys() and "mtp.fc.weight" in got
    for name, tensor in got.items():
        if "norm" in name:  # every norm of the head is zero-centred
            torch.testing.assert_close(1 + tensor, 1 + expected[name], rtol=0, atol=1e-6)
        else:
            assert torch.equal(tensor, expected[name]), name
    # Without --spec mtp the same file serves the text model alone.
    assert getattr(load_model(gguf_path, CPU, torch.float32).model, "mtp", None) is None
