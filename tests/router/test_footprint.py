"""The planner's footprint estimate (router/footprint.py) against what the
CPU engine really allocates (Ready.memory: weights and KV) for tiny models,
from safetensors headers and from GGUF tensor infos."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.process.bootstrap import build_engine
from protocol import EngineOptions
from router.footprint import CUDA_CONTEXT_BYTES, estimate_footprint, read_shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reported(model: Path, options: EngineOptions):
    _, ready = build_engine(model, options, lambda fraction, message: None, lambda event: None)
    return ready.memory


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("options", [
    EngineOptions(),
    EngineOptions(max_context=512, prefix_cache_tokens=100, max_concurrency=3),
    EngineOptions(kv_capacity_tokens=3000, page_size=32),
    EngineOptions(max_context=512, kv_dtype="fp8"),
])
def test_safetensors_estimate_matches_the_cpu_engine(tiny_model_factory, arch: str,
                                                     options: EngineOptions) -> None:
    model = tiny_model_factory(arch)
    estimate = estimate_footprint(read_shape(model, "hf"), options, cuda=False)
    memory = reported(model, options)
    assert (estimate.weights_bytes, estimate.kv_bytes) == (memory.weights_bytes, memory.kv_bytes)
    assert estimate.activation_bytes == estimate.runtime_bytes == 0


def test_gguf_estimate_matches_the_cpu_engine(smollm2_gguf: Path) -> None:
    # Q4_1 on disk, dequantized to the serving dtype at load.
    options = EngineOptions(max_context=1024, max_concurrency=2)
    estimate = estimate_footprint(read_shape(smollm2_gguf, "gguf"), options, cuda=False)
    memory = reported(smollm2_gguf, options)
    assert (estimate.weights_bytes, estimate.kv_bytes) == (memory.weights_bytes, memory.kv_bytes)
    assert estimate.weights_bytes > 4 * smollm2_gguf.stat().st_size  # float32, not Q4_1


def test_on_cuda_bfloat16_and_allowances(tiny_model_factory) -> None:
    shape = read_shape(tiny_model_factory("qwen3"), "hf")
    cpu = estimate_footprint(shape, EngineOptions(), cuda=False)
    gpu = estimate_footprint(shape, EngineOptions(), cuda=True)
    assert gpu.weights_bytes * 2 == cpu.weights_bytes and gpu.kv_bytes * 2 == cpu.kv_bytes
    assert gpu.runtime_bytes == CUDA_CONTEXT_BYTES and gpu.activation_bytes > 0
    assert gpu.grant_bytes == gpu.total_bytes - CUDA_CONTEXT_BYTES
    # kv-capacity auto: the least it runs in is one full context.
    fill = estimate_footprint(shape, EngineOptions(kv_capacity_tokens=-1), cuda=True)
    assert fill.kv_tokens == shape.trained_context


def test_an_unreadable_checkpoint_says_why(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="tensor shapes"):
        read_shape(tmp_path, "hf")
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_shape(bad, "gguf")


@pytest.mark.parametrize("options", [
    EngineOptions(expert_residency="host"),
    EngineOptions(host_expert_layers=2),
    EngineOptions(),
])
def test_experts_in_host_memory_leave_the_estimate_as_they_leave_the_engine(
        tiny_model_factory, tmp_path: Path, options: EngineOptions) -> None:
    from tests.engine.test_moe_gguf import write_moe_gguf

    hf_dir = tiny_model_factory("qwen3_moe")
    gguf_file = write_moe_gguf(tiny_model_factory("qwen3_moe_all_sparse"),
                               tmp_path / "moe.gguf", "qwen3_moe")
    for model, format in ((hf_dir, "hf"), (gguf_file, "gguf")):
        shape = read_shape(model, format)
        estimate = estimate_footprint(shape, options, cuda=False)
        memory = reported(model, options)
        assert estimate.weights_bytes == memory.weights_bytes, (model.name, options)
        host = shape.host_expert_elements(options.host_expert_layer_count) * 4
        assert host == memory.host_weights_bytes
        assert (host > 0) == options.host_experts


def test_the_expert_cache_is_planned_on_the_gpu_only(tiny_model_factory) -> None:
    shape = read_shape(tiny_model_factory("qwen3_moe"), "hf")
    host = EngineOptions(expert_residency="host")
    cached = EngineOptions(expert_residency="host", expert_cache_mib=512)
    gpu, gpu_cached = (estimate_footprint(shape, o, cuda=True) for o in (host, cached))
    assert gpu_cached.activation_bytes - gpu.activation_bytes == 512 * 2**20
    assert gpu_cached.weights_bytes == gpu.weights_bytes
    assert estimate_footprint(shape, cached, cuda=False) == estimate_footprint(shape, host,
                                                                                cuda=False)


def test_a_gpu_engine_keeps_quantized_gguf_matrices_packed(tmp_path: Path) -> None:
    # With --gguf-weights packed, on CUDA in bfloat16, the engine keeps Q8_0/Q4_0/K-quant projections in
    # their blocks (engine/loader/packing.py): the estimate counts their file
    # bytes, as the packed load's weights do; a fused matrix with one part of
    # another type (layer 1's v in Q5_0) is dequantized whole, in both.
    import torch
    from gguf import GGMLQuantizationType as T

    from engine.loader import load_model
    from engine.process.bootstrap import loaded_weights_bytes
    from tests.engine.quantized_gguf import MATRICES, Q4_K_M_MIX, write_quantized_gguf

    for label, mix in (("q8_0", {name: T.Q8_0 for name in MATRICES}),
                       ("mixed", {**Q4_K_M_MIX, "blk.1.attn_v.weight": T.Q5_0})):
        path = write_quantized_gguf(tmp_path / f"{label}.gguf", mix)
        shape = read_shape(path, "gguf")
        estimate = estimate_footprint(shape, EngineOptions(gguf_weights="packed"), cuda=True)
        packed = load_model(path, torch.device("cpu"), torch.bfloat16, packed_quant=True)
        assert estimate.weights_bytes == loaded_weights_bytes(packed), label
        # By default a GGUF is dequantized at load: every element in bf16.
        plain = load_model(path, torch.device("cpu"), torch.bfloat16, packed_quant=False)
        assert estimate_footprint(shape, EngineOptions(), cuda=True).weights_bytes \
            == loaded_weights_bytes(plain), label
        # Served in float32 (or on the CPU) everything is dequantized.
        wide = estimate_footprint(shape, EngineOptions(dtype="float32"), cuda=True)
        assert wide.weights_bytes == 4 * (shape.weight_elements + 1024 * 64), label
