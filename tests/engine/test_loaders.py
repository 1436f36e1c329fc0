"""load_model on GGUF files and Hugging Face directories: configs, weights, errors, progress."""

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
from safetensors.torch import save_file

from engine.execution.attention_metadata import AttentionMetadata
from engine.loader import LoadedModel, load_model, open_checkpoint
from engine.models import CausalLM, ModelConfig

CPU = torch.device("cpu")

# llama.cpp's tensor names, written out independently of the loader's own table.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{suffix}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to Llama q/k rows."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def add_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])


def write_gguf(hf_dir: Path, target: Path, arch: str, half_matrices: bool = False) -> Path:
    """Convert a tiny HF model to GGUF as llama.cpp would (F32, or F16 matrices)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(target, arch)
    add_metadata(writer, cfg)
    with safe_open(hf_dir / "model.safetensors", framework="np") as handle:
        for name in sorted(handle.keys()):
            if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
                continue
            array = handle.get_tensor(name)
            if arch == "llama" and ".q_proj." in name:
                array = llama_cpp_permute(array, cfg["num_attention_heads"])
            elif arch == "llama" and ".k_proj." in name:
                array = llama_cpp_permute(array, cfg["num_key_value_heads"])
            if half_matrices and array.ndim == 2:
                array = array.astype(np.float16)
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def prefill_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of one sequence run as a single prefill over pages 0, 1, ..."""
    page_size, tokens = 16, len(ids)
    pages = -(-tokens // page_size)
    cfg = model.config
    caches = [
        tuple(
            torch.zeros(cfg.kv_cache_shape(pages, page_size), dtype=model.embed_tokens.dtype)
            for _ in range(2)
        )
        for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.arange(pages, dtype=torch.int32)[None],
        slot_mapping=torch.arange(tokens),
        max_query_len=tokens,
        max_seq_len=tokens,
        query_start_loc_host=(0, tokens),
        seq_lens_host=(tokens,),
    )
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(tokens), meta, caches))


def assert_same_weights(ours: CausalLM, reference: CausalLM, transform=lambda t: t) -> None:
    expected = reference.weight_destinations()
    got = ours.weight_destinations()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, transform(expected[name])), f"{name} differs"


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> tuple[LoadedModel, list[tuple[float, str]]]:
    calls: list[tuple[float, str]] = []
    loaded = load_model(
        smollm2_gguf, CPU, torch.float32, progress=lambda f, m: calls.append((f, m))
    )
    return loaded, calls


def test_smollm2_gguf_config(smollm2) -> None:
    config = smollm2[0].config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 64 * 2


def test_smollm2_uses_tied_head_and_reports_progress(smollm2, smollm2_gguf: Path) -> None:
    loaded, calls = smollm2
    model = loaded.model
    assert model.lm_head.data_ptr() == model.embed_tokens.data_ptr()
    hidden = torch.randn(2, 576)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.embed_tokens.T)
    assert loaded.n_params == 134_515_008  # the embedding counted once
    assert loaded.size_bytes == smollm2_gguf.stat().st_size
    fractions = [f for f, _ in calls]
    assert fractions[-1] == 1.0 and fractions == sorted(fractions)
    assert 20 <= len(fractions) <= 102, "throttled to about one call per percent"
    assert all(isinstance(message, str) and message for _, message in calls)


@pytest.mark.parametrize(("arch", "half"), [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_gguf_directory_matches_hf_directory(
    arch: str, half: bool, tiny_model_factory, tmp_path: Path
) -> None:
    hf_dir = tiny_model_factory(arch)
    write_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", arch, half_matrices=half)
    from_gguf = load_model(tmp_path, CPU, torch.float32)  # a directory holding one .gguf
    from_hf = load_model(hf_dir, CPU, torch.float32)
    hf_config = from_hf.config
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=hf_config.rms_norm_eps) == hf_config
    # Exact after undoing llama.cpp's q/k permutation (and the F16 rounding where written so).
    assert_same_weights(
        from_gguf.model,
        from_hf.model,
        (lambda t: t.half().float() if t.dim() == 2 else t) if half else (lambda t: t),
    )
    assert from_gguf.size_bytes == (tmp_path / f"tiny-{arch}.gguf").stat().st_size


def test_sharded_safetensors(tiny_model_factory, tmp_path: Path) -> None:
    source = tiny_model_factory("llama")
    with safe_open(source / "model.safetensors", framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard_names in shards.items():
        save_file(
            {n: tensors[n] for n in shard_names}, str(tmp_path / file), metadata={"format": "pt"}
        )
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copyfile(source / "config.json", tmp_path / "config.json")
    sharded = load_model(tmp_path, CPU, torch.float32)
    assert_same_weights(sharded.model, load_model(source, CPU, torch.float32).model)
    assert sharded.size_bytes == sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))


def test_bfloat16_load_tracks_float32(tiny_model_factory) -> None:
    path = tiny_model_factory("llama")
    ids = list(range(1000, 1040))
    full = prefill_logits(load_model(path, CPU, torch.float32).model, ids)
    half = load_model(path, CPU, torch.bfloat16)
    assert half.model.embed_tokens.dtype == torch.bfloat16
    logits = prefill_logits(half.model, ids)
    assert logits.dtype == torch.float32
    diff = (logits - full).abs().max().item()
    assert diff < 0.1 * full.abs().max().item(), f"bf16 logits drift by {diff:.3f}"


# -- errors ------------------------------------------------------------------------


def _hf_copy(source: Path, target: Path, **config_changes) -> Path:
    target.mkdir()
    cfg = json.loads((source / "config.json").read_text())
    cfg.update(config_changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (target / "config.json").write_text(json.dumps(cfg))
    (target / "model.safetensors").symlink_to(source / "model.safetensors")
    return target


def test_unknown_or_missing_hf_architecture(tiny_model_factory, tmp_path: Path) -> None:
    source = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="FooForCausalLM"):
        load_model(
            _hf_copy(source, tmp_path / "foo", architectures=["FooForCausalLM"]), CPU, torch.float32
        )
    with pytest.raises(ValueError, match="architectures"):
        load_model(_hf_copy(source, tmp_path / "none", architectures=None), CPU, torch.float32)


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path / "gpt2.gguf", CPU, torch.float32)


def test_unsupported_gguf_tensor_type(tiny_model_factory, tmp_path: Path) -> None:
    cfg = json.loads((tiny_model_factory("llama") / "config.json").read_text())
    writer = gguf.GGUFWriter(tmp_path / "q81.gguf", "llama")
    add_metadata(writer, cfg)
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((64, 64 // block_size * type_size), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="Q8_1"):
        load_model(tmp_path / "q81.gguf", CPU, torch.float32)


def test_missing_weight_is_named(tiny_model_factory, tmp_path: Path) -> None:
    source = tiny_model_factory("qwen2")
    with safe_open(source / "model.safetensors", framework="pt") as handle:
        tensors = {
            n: handle.get_tensor(n)
            for n in handle.keys()
            if n != "model.layers.1.mlp.up_proj.weight"
        }
    (tmp_path / "config.json").write_bytes((source / "config.json").read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path, CPU, torch.float32)


def test_paths_that_hold_no_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nowhere", CPU, torch.float32)
    with pytest.raises(ValueError, match=r"neither config\.json"):
        load_model(tmp_path, CPU, torch.float32)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"2 \.gguf files"):
        open_checkpoint(tmp_path)
    (tmp_path / "b.gguf").unlink()
    with pytest.raises(ValueError, match=r"a\.gguf is not a readable GGUF file"):
        open_checkpoint(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        open_checkpoint(tmp_path / "weights.bin")


# -- config.json variants ----------------------------------------------------------------

_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def test_transformers4_llama31_config() -> None:
    config = ModelConfig.from_hf_config(_LLAMA31)
    assert config.rope_theta == 500000.0 and config.head_dim == 128
    assert config.rope_scaling == {**_LLAMA31["rope_scaling"]}
    assert not config.tie_word_embeddings and (config.q_size, config.kv_size) == (4096, 1024)


def test_transformers5_rope_parameters_and_sliding_window() -> None:
    # transformers 5 writes rope_parameters instead of rope_theta/rope_scaling.
    base = {k: v for k, v in _LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    mistral = {
        **base,
        "architectures": ["MistralForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_window": 4096,
        "max_position_embeddings": 32768,
        "eos_token_id": 2,
    }
    config = ModelConfig.from_hf_config(mistral)
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)
    assert config.max_position_embeddings == 4096, (
        "served up to the window, where attention is exact"
    )


def test_unsupported_rope_scaling_is_rejected() -> None:
    yarn = {**_LLAMA31, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config(yarn)
