"""GGUF matrices kept in their quantized blocks (engine/loader/packing.py), on the CPU.

The packed load is forced on (packed_quant=True; the CPU default stays the
dequantizing load) and runs on the reference ops, which dequantize each
packed matrix for its product: the logits must be exactly those of the same
file loaded dequantized, through the whole engine too, across sleep and wake.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from torch import nn

import protocol as p
from engine.execution import model_runner
from engine.execution.device_state import WeightStash, model_tensors
from engine.execution.quantized_weight import QuantizedWeight, quantized_weights
from engine.loader import load_model
from engine.models.hybrid_layers import GatedAttention
from engine.process import bootstrap
from engine.process.bootstrap import loaded_weights_bytes
from router.footprint import read_shape
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.engine.quantized_gguf import MATRICES, Q4_K_M_MIX, tensor_bytes, write_quantized_gguf
from tests.engine.test_loaders import prefill_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
MIXES = {
    "q8_0": {name: T.Q8_0 for name in MATRICES},
    "q4_k_m": Q4_K_M_MIX,
}
# Kept as they are in any mix: the embedding table is read by rows, not multiplied.
NEVER_PACKED = {"token_embd.weight"}


@pytest.fixture(scope="module", params=sorted(MIXES))
def quantized_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Path:
    mix = MIXES[request.param]
    return write_quantized_gguf(tmp_path_factory.mktemp("packed") / f"{request.param}.gguf", mix)


def slot_types(model: nn.Module) -> dict[str, str]:
    return {name: module.describe() for name, module in model.named_modules()
            if isinstance(module, QuantizedWeight)}


def test_packed_load_gives_the_dequantized_logits(quantized_file: Path) -> None:
    packed = load_model(quantized_file, CPU, torch.float32, packed_quant=True)
    plain = load_model(quantized_file, CPU, torch.float32)
    assert not quantized_weights(plain.model)
    types = slot_types(packed.model)
    # Every projection and the lm_head: 2 layers x (qkv, o, gate_up, down) + lm_head.
    assert len(types) == 9 and "lm_head" in types
    if "q4_k_m" in quantized_file.name:
        assert types["layers.0.self_attn.qkv_weight"] == "Q4_K+Q4_K+Q6_K"
        assert types["layers.1.mlp.down_weight"] == "Q6_K"
    assert isinstance(packed.model.embed_tokens, nn.Parameter)
    # The packed bytes are the file's bytes of those tensors.
    packed_bytes = sum(w.nbytes for w in quantized_weights(packed.model))
    assert packed_bytes == tensor_bytes(quantized_file, set(MATRICES) - NEVER_PACKED)
    assert packed.n_params == plain.n_params
    for prompt in ([1, 5, 9, 200, 17, 3], list(range(3, 60))):
        assert torch.equal(prefill_logits(packed.model, prompt), prefill_logits(plain.model, prompt))


def test_the_ledger_counts_packed_bytes(quantized_file: Path) -> None:
    packed = load_model(quantized_file, CPU, torch.bfloat16, packed_quant=True)
    plain = load_model(quantized_file, CPU, torch.bfloat16)
    weights = quantized_weights(packed.model)
    elements = sum(w.shape.numel() for w in weights)
    assert loaded_weights_bytes(packed) == (loaded_weights_bytes(plain) - 2 * elements
                                            + sum(w.nbytes for w in weights))


def test_the_cpu_default_is_the_dequantizing_load(quantized_file: Path) -> None:
    assert not quantized_weights(load_model(quantized_file, CPU, torch.float32).model)


def test_types_without_kernels_are_dequantized_and_named(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    mix = {**MIXES["q8_0"], "blk.1.attn_v.weight": T.Q5_0, "blk.0.ffn_down.weight": T.Q4_1,
           "blk.0.ffn_up.weight": T.F32}
    path = write_quantized_gguf(tmp_path / "mixed.gguf", mix)
    with caplog.at_level(logging.INFO, logger="engine.loader.packing"):
        packed = load_model(path, CPU, torch.float32, packed_quant=True)
    model = packed.model
    # One unpackable part keeps its whole fused slot dequantized.
    assert isinstance(model.layers[1].self_attn.qkv_weight, nn.Parameter)
    assert isinstance(model.layers[0].mlp.gate_up_weight, nn.Parameter)
    assert isinstance(model.layers[0].mlp.down_weight, nn.Parameter)
    assert isinstance(model.layers[0].self_attn.qkv_weight, QuantizedWeight)
    assert len(slot_types(model)) == 6
    (line,) = [r.getMessage() for r in caplog.records if "kept packed" in r.getMessage()]
    # Packed: layer 0's q, k, v and o, layer 1's o, gate, up and down, lm_head.
    assert "9 quantized tensors kept packed" in line and "Q8_0 9" in line
    # Dequantized: Q5_0 and Q4_1 (no kernels), and the Q8_0 embedding, layer 1's
    # q and k (fused with the Q5_0 v) and layer 0's gate (fused with an F32 up).
    assert "dequantized: Q4_1 1, Q5_0 1, Q8_0 4" in line
    plain = load_model(path, CPU, torch.float32)
    prompt = list(range(5, 40))
    assert torch.equal(prefill_logits(model, prompt), prefill_logits(plain.model, prompt))


def _greedy(core, events, request_id: str, prompt: list[int]) -> list[int]:
    params = p.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = step_outputs(run_to_completion(core, events, {request_id: (prompt, params)}))
    return [t for o in outputs for t in o.token_ids]


PROMPTS = [[1, 7, 300, 42, 9] * 4, list(range(10, 47)), [3] * 11]


def test_engine_serves_packed_weights_through_sleep_and_wake(
        quantized_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"page_size": 8, "max_batched_tokens": 16, "max_concurrency": 2,
               "kv_capacity_tokens": 512}
    core, events = in_process.make_engine(quantized_file, **options)
    expected = [_greedy(core, events, f"plain{i}", prompt) for i, prompt in enumerate(PROMPTS)]
    # The engine's own loads (start-up and a disk wake) with packing forced on.
    packed_load = functools.partial(load_model, packed_quant=True)
    monkeypatch.setattr(bootstrap, "load_model", packed_load)
    monkeypatch.setattr(model_runner, "load_model", packed_load)
    core, events = in_process.make_engine(quantized_file, **options)
    model = core.runner.model
    assert len(quantized_weights(model)) == 9
    assert [_greedy(core, events, f"packed{i}", prompt)
            for i, prompt in enumerate(PROMPTS)] == expected
    before = {name: t.clone() for name, t in model_tensors(model).items()}
    for weights in ("disk", "host"):
        core.handle(p.Sleep(weights=weights))  # type: ignore[arg-type]
        core.handle(p.Wake())
        assert not core.asleep
        after = model_tensors(model)
        assert after.keys() == before.keys()
        assert all(torch.equal(after[name], t) for name, t in before.items())
        assert len(quantized_weights(model)) == 9
        assert _greedy(core, events, f"woken-{weights}", PROMPTS[1]) == expected[1]
    # The host copy CUDA sleeps with, unpinned on the CPU: the blocks go and come back.
    stash = WeightStash(model, pin=False)
    assert all(w.segments()[0].packed.numel() == 0 for w in quantized_weights(model))
    stash.put_back(model, CPU)
    assert all(torch.equal(model_tensors(model)[name], t) for name, t in before.items())


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_hybrid_models_pack_only_what_their_loader_renames(
        family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf
    import numpy as np

    from tests.engine.test_hybrid_gguf import _FAMILIES, build_hf_model, convert_to_llama_cpp

    add_tensor = gguf.GGUFWriter.add_tensor

    def quantized(writer, name, array, *args, **kwargs):  # type: ignore[no-untyped-def]
        # The converter's matrices in Q8_0, as llama.cpp's quantizer would leave them.
        if array.ndim == 2 and array.dtype == np.float32 and array.shape[1] % 32 == 0:
            packed = gguf.quants.quantize(array, T.Q8_0)
            return add_tensor(writer, name, packed, raw_dtype=T.Q8_0)
        return add_tensor(writer, name, array, *args, **kwargs)

    build_hf_model(family, tmp_path)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", quantized)
    path = convert_to_llama_cpp(tmp_path, tmp_path / f"{family}.gguf", _FAMILIES[family][0])
    monkeypatch.undo()
    packed = load_model(path, CPU, torch.float32, packed_quant=True).model
    plain = load_model(path, CPU, torch.float32).model
    slots = slot_types(packed)
    # The gated attention's projections (its q rows keep the query/gate interleave).
    attention = [name for name in slots if name.endswith(("mixer.qkv_weight", "mixer.o_weight"))]
    assert len(attention) == 2 * sum(isinstance(layer.mixer, GatedAttention)
                                     for layer in packed.layers) > 0
    assert "lm_head" in slots
    # The linear-attention input projections are regrouped or reordered at load.
    assert not any(name.endswith("in_proj_weight") for name in slots)
    # Qwen3-Next's ssm_out passes as stored; Qwen3.5 reorders its columns.
    assert any(name.endswith("out_weight") for name in slots) == (family == "qwen3_next")
    # The router's estimate (router/footprint.py) counts the same matrices packed.
    shape = read_shape(path, "gguf")
    weights = quantized_weights(packed)
    assert shape.packed_bytes == sum(w.nbytes for w in weights)
    assert shape.packed_elements == sum(w.shape.numel() for w in weights)
    plain_tensors = dict(plain.named_parameters())
    for name, module in packed.named_modules():
        if isinstance(module, QuantizedWeight):
            assert torch.equal(module.dequantize(), plain_tensors[name]), name
    for name, tensor in packed.named_parameters():
        assert torch.equal(tensor, plain_tensors[name]), name


def test_packing_is_asked_for_and_refused_where_our_kernels_do_not_run(
        quantized_file: Path) -> None:
    """By default a GGUF loads dequantized (the packed kernels are slower
    than bf16 for now); --gguf-weights packed is the operator's choice, and
    on the CPU, where only the reference ops run, it is refused."""
    assert not quantized_weights(load_model(quantized_file, CPU, torch.float32).model)
    with pytest.raises(ValueError, match="--gguf-weights packed"):
        load_model(quantized_file, CPU, torch.bfloat16, gguf_packed=True)
    with pytest.raises(ValueError, match="--gguf-weights packed"):
        in_process.make_engine(quantized_file, gguf_weights="packed", kv_capacity_tokens=512)
    with pytest.raises(ValueError, match="gguf-weights must be one of"):
        p.EngineOptions(gguf_weights="bf16")
