"""Programmatic Dependent Launch without a GPU: the driver structs against the
CUDA header, the argument marshalling, the launch decision in
kernels.cuda_build.launch, the header pasting, and the PDL-aware kernels'
machine code (nvcc, and cuobjdump where present): every declared kernel
waits for its predecessor before its first global memory access, and none
of its threads leaves before it waits."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kernels import cuda_build, pdl
from tests.kernels.sass_checks import (
    cuobjdump_path,
    first_global_access_before_wait,
    leaves_before_wait,
)

CSRC = cuda_build.SOURCE_DIR
HEADER = "pdl.cuh"
# Every source whose pasted text has pdl.cuh (directly or through another
# header), and so declares PDL-aware kernels.
PDL_SOURCES = sorted(p.name for p in CSRC.glob("*.cu")
                     if f'#line 1 "{HEADER}"' in cuda_build.source_text(p.name))


# --- the driver structs ---------------------------------------------------------

def test_struct_layouts_are_the_cuda_13_headers() -> None:
    # Numbers read from /usr/local/cuda-13.0/include/cuda.h with offsetof/sizeof.
    assert ctypes.sizeof(pdl.LaunchConfig) == 56
    assert ctypes.alignment(pdl.LaunchConfig) == 8
    assert [getattr(pdl.LaunchConfig, f).offset for f in
            ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
             "shared_mem_bytes", "stream", "attrs", "num_attrs")] == \
        [0, 4, 8, 12, 16, 20, 24, 32, 40, 48]
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72
    assert pdl.LaunchAttribute.id.offset == 0
    assert pdl.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(pdl.LaunchAttributeValue) == 64
    assert pdl.LaunchAttributeValue.programmatic_stream_serialization_allowed.offset == 0
    assert pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6


def _cuda_header() -> Path | None:
    candidates = sorted(Path("/usr/local").glob("cuda*/include/cuda.h"), reverse=True)
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends/nvidia/include/cuda.h")
    except ImportError:
        pass
    return next((c for c in candidates if c.is_file()), None)


def test_struct_layouts_match_a_real_cuda_header(tmp_path: Path) -> None:
    header, cc = _cuda_header(), shutil.which("gcc") or shutil.which("cc")
    if header is None or cc is None:
        pytest.skip("needs cuda.h and a C compiler")
    (tmp_path / "layout.c").write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\n"
        "int main(void) { printf(\"%zu %zu %zu %zu %zu %zu %zu %zu %d\\n\",\n"
        "  sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes),\n"
        "  offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),\n"
        "  offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute),\n"
        "  offsetof(CUlaunchAttribute, value), sizeof(CUlaunchAttributeValue),\n"
        "  (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION); return 0; }\n")
    subprocess.run([cc, f"-I{header.parent}", str(tmp_path / "layout.c"), "-o",
                    str(tmp_path / "layout")], check=True, capture_output=True)
    printed = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True,
                             text=True).stdout.split()
    assert [int(v) for v in printed] == [
        ctypes.sizeof(pdl.LaunchConfig), pdl.LaunchConfig.shared_mem_bytes.offset,
        pdl.LaunchConfig.stream.offset, pdl.LaunchConfig.attrs.offset,
        pdl.LaunchConfig.num_attrs.offset, ctypes.sizeof(pdl.LaunchAttribute),
        pdl.LaunchAttribute.value.offset, ctypes.sizeof(pdl.LaunchAttributeValue),
        pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]


# --- argument marshalling ---------------------------------------------------------

def _read(pointer: int, ctype: Any) -> Any:
    return ctypes.cast(pointer, ctypes.POINTER(ctype)).contents.value


def test_kernel_params_point_at_each_argument_in_its_c_type() -> None:
    args = (np.uint64(2**63 + 7), np.int32(-5), np.float32(0.1), np.int64(-(2**40)),
            np.uint32(2**32 - 1), np.float64(1e300))
    params, values = pdl.kernel_params(args)
    expected = [(ctypes.c_uint64, 2**63 + 7), (ctypes.c_int32, -5),
                (ctypes.c_float, float(np.float32(0.1))), (ctypes.c_int64, -(2**40)),
                (ctypes.c_uint32, 2**32 - 1), (ctypes.c_double, 1e300)]
    assert len(values) == len(args)
    for pointer, (ctype, value) in zip(params, expected, strict=True):
        assert _read(pointer, ctype) == value
    # float32 arguments keep their bits (no widening to double on the way).
    bits = _read(params[2], ctypes.c_uint32)
    assert bits == np.float32(0.1).view(np.uint32)


@pytest.mark.parametrize("arg", [5, 1.5, True, np.float16(1), np.bool_(True), np.int8(1),
                                 np.array([1], dtype=np.int32), "x", None])
def test_kernel_params_refuse_what_has_no_kernel_parameter_type(arg: Any) -> None:
    with pytest.raises(TypeError, match="argument 1"):
        pdl.kernel_params((np.int32(0), arg))


# --- pdl.launch against a fake driver ------------------------------------------------

class FakeDriver:
    def __init__(self, result: int = 0) -> None:
        self.result = result
        self.calls: list[dict[str, Any]] = []
        self._error_name = ctypes.c_char_p(b"CUDA_ERROR_INVALID_VALUE")

    def cuLaunchKernelEx(self, config: Any, function: int, params: Any, extra: Any) -> int:
        cfg = config._obj
        attr = cfg.attrs[0]
        self.calls.append({
            "grid": (cfg.grid_x, cfg.grid_y, cfg.grid_z),
            "block": (cfg.block_x, cfg.block_y, cfg.block_z),
            "shared": cfg.shared_mem_bytes, "stream": cfg.stream, "num_attrs": cfg.num_attrs,
            "attr": (attr.id, attr.value.programmatic_stream_serialization_allowed),
            "function": function, "extra": extra,
            "args": (_read(params[0], ctypes.c_uint64), _read(params[1], ctypes.c_int32),
                     _read(params[2], ctypes.c_float)),
        })
        return self.result

    def cuGetErrorName(self, result: int, name: Any) -> int:
        name._obj.value = self._error_name.value
        return 0


def test_launch_passes_the_programmatic_attribute_and_arguments() -> None:
    driver = FakeDriver()
    pdl.launch(0xABC, (7,), (256, 2), (np.uint64(0xDEAD), np.int32(3), np.float32(2.5)),
               stream=0x1234, shared_bytes=96, driver=driver)
    assert driver.calls == [{
        "grid": (7, 1, 1), "block": (256, 2, 1), "shared": 96, "stream": 0x1234,
        "num_attrs": 1, "attr": (6, 1), "function": 0xABC, "extra": None,
        "args": (0xDEAD, 3, 2.5),
    }]


def test_launch_raises_with_the_drivers_error_name() -> None:
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_INVALID_VALUE \(1\)"):
        pdl.launch(1, (1,), (32,), (np.uint64(0), np.int32(0), np.float32(0)), stream=1,
                   driver=FakeDriver(result=1))


def test_launch_refuses_a_grid_of_four_dimensions() -> None:
    with pytest.raises(ValueError, match="grid"):
        pdl.launch(1, (1, 1, 1, 1), (32,), (), stream=1, driver=FakeDriver())


# --- the launch decision in cuda_build.launch ----------------------------------------

class FakeKernel:
    """A CuPy RawKernel's call interface: records the CuPy-path launches."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, grid: Any, block: Any, args: Any, *, shared_mem: int, stream: Any) -> None:
        self.calls.append((grid, block, args, shared_mem))


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """cuda_build.launch with torch's stream, CuPy and the driver faked:
    capturing, Hopper and the switch on unless a test changes them."""
    state: dict[str, Any] = {"capturing": True, "hopper": True, "pdl_launches": []}
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        Device=lambda index: _NullContext(),
        ExternalStream=lambda pointer, index: ("external", pointer))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda index=None: types.SimpleNamespace(cuda_stream=0x5000))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(cuda_build, "_pdl_capable", lambda index: state["hopper"])
    monkeypatch.setattr(cuda_build, "_function_pointer", lambda kernel: 0xF00)
    monkeypatch.setattr(cuda_build, "_external_stream", lambda pointer, index: ("ext", pointer))
    monkeypatch.setattr(cuda_build.pdl, "launch",
                        lambda *a, **kw: state["pdl_launches"].append((a, kw)))
    monkeypatch.setattr(cuda_build, "_PDL_KERNELS", set())
    previous = cuda_build.set_pdl(True)
    yield state
    cuda_build.set_pdl(previous)


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _launch(kernel: FakeKernel) -> None:
    cuda_build.launch(kernel, (3,), (64,), (np.int32(1),), torch.device("cuda", 0),
                      shared_bytes=16)


def test_a_pdl_aware_kernel_in_a_capture_launches_with_pdl(launch_env: dict[str, Any]) -> None:
    kernel = FakeKernel()
    cuda_build._PDL_KERNELS.add(kernel)
    _launch(kernel)
    assert kernel.calls == []
    assert launch_env["pdl_launches"] == [((0xF00, (3,), (64,), (np.int32(1),), 0x5000, 16), {})]


@pytest.mark.parametrize("case", ["switch off", "not pdl-aware", "not capturing", "pre-Hopper"])
def test_otherwise_the_kernel_takes_cupys_path(launch_env: dict[str, Any], case: str) -> None:
    kernel = FakeKernel()
    if case != "not pdl-aware":
        cuda_build._PDL_KERNELS.add(kernel)
    if case == "switch off":
        cuda_build.set_pdl(False)
    launch_env["capturing"] = case != "not capturing"
    launch_env["hopper"] = case != "pre-Hopper"
    _launch(kernel)
    assert launch_env["pdl_launches"] == []
    assert kernel.calls == [((3,), (64,), (np.int32(1),), 16)]


def test_set_pdl_returns_the_previous_setting() -> None:
    before = cuda_build.pdl_enabled()
    try:
        assert cuda_build.set_pdl(False) is before
        assert cuda_build.pdl_enabled() is False
        assert cuda_build.set_pdl(True) is False
        assert cuda_build.pdl_enabled() is True
    finally:
        cuda_build.set_pdl(before)


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("", True), ("0", False)])
def test_the_environment_switch(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                on: bool) -> None:
    if value is None:
        monkeypatch.delenv("ROUNDHOUSE_PDL", raising=False)
    else:
        monkeypatch.setenv("ROUNDHOUSE_PDL", value)
    assert cuda_build.pdl_from_environment() is on


def test_load_kernel_registers_the_kernels_a_source_declares(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        Device=lambda index: _NullContext())
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    module = types.SimpleNamespace(get_function=lambda name: FakeKernel())
    monkeypatch.setattr(cuda_build, "_module", lambda source, index: module)
    monkeypatch.setattr(cuda_build, "_PDL_KERNELS", set())
    load = cuda_build.load_kernel.__wrapped__  # past the cache: these are fakes
    aware = load("skinny_gemm.cu", "skinny_gemm_m1_rg2", 0)
    plain = load("skinny_gemm.cu", "skinny_rows_t1_rg1", 0)
    other = load("sampling.cu", "sample_tokens_f32", 0)
    assert cuda_build.is_pdl_aware(aware)
    assert not cuda_build.is_pdl_aware(plain)
    assert not cuda_build.is_pdl_aware(other)


def test_declarations_name_the_decode_steps_kernels() -> None:
    assert cuda_build.declared_pdl_aware("norm.cu", "add_rms_norm_warp4")
    assert cuda_build.declared_pdl_aware("skinny_gemm.cu", "skinny_gemm_m8_rg1")
    assert not cuda_build.declared_pdl_aware("skinny_gemm.cu", "skinny_rows_t8_rg1")
    assert cuda_build.declared_pdl_aware("activation.cu", "silu_and_mul_bf16")
    assert cuda_build.declared_pdl_aware("rope_cache.cu", "rope_and_cache_d128_fp8")
    assert cuda_build.declared_pdl_aware("decode_attention.cu", "paged_decode_reduce")
    assert cuda_build.declared_pdl_aware("decode_attention.cu", "paged_decode_d128_g8_fp8")
    assert cuda_build.pdl_kernel_patterns("prefill_attention.cu") == ()


@pytest.mark.parametrize(("source", "name"), [
    # Packed GGUF and FP8 linears: the decode GEMVs and, for many-row steps,
    # the dequantization into the scratch.
    ("gguf_gemv_small.cu", "gguf_gemv_small_Q4_K_m1"),
    ("gguf_gemv_small.cu", "gguf_gemv_small_Q8_0_m4"),
    ("gguf_quant.cu", "gguf_gemv_Q6_K_nt2"),
    ("gguf_quant.cu", "gguf_dequantize_Q4_0"),
    ("fp8_linear.cu", "fp8_gemv_nt1"),
    ("fp8_linear.cu", "fp8_dequantize"),
    # Mixture of experts.
    ("moe.cu", "moe_route_bf16"),
    ("moe.cu", "moe_route_f32"),
    ("moe.cu", "moe_gate_up_silu"),
    ("moe.cu", "moe_down_sum"),
    ("shared_expert.cu", "shared_expert_combine"),
    # Hybrid (Gated DeltaNet and gated attention) layers.
    ("gated_delta.cu", "causal_conv1d_k4"),
    ("gated_delta.cu", "conv_state_update_k4"),
    ("gated_delta.cu", "gated_delta_rule_dk128"),
    ("gated_norm.cu", "gated_rms_norm_d128"),
    ("gated_rope_cache.cu", "gated_rope_and_cache_d256_fp8"),
    ("gated_rope_cache.cu", "sigmoid_gate_mul"),
])
def test_declarations_name_the_other_models_decode_kernels(source: str, name: str) -> None:
    assert cuda_build.declared_pdl_aware(source, name)


def test_kernels_outside_the_decode_graphs_are_not_declared() -> None:
    # Sampling runs eagerly after the graph's replay; the chunked delta rule
    # serves prompt chunks only.
    assert cuda_build.pdl_kernel_patterns("sampling.cu") == ()
    assert cuda_build.pdl_kernel_patterns("gated_delta_chunked.cu") == ()


# --- header pasting -------------------------------------------------------------

def test_source_text_pastes_local_headers_once_with_line_directives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("#pragma once\nint b;\n")
    (tmp_path / "k.cu").write_text(
        '#include <cuda_bf16.h>\n#include "a.cuh"\n#include "b.cuh"\nint k;\n')
    monkeypatch.setattr(cuda_build, "SOURCE_DIR", tmp_path)
    text = cuda_build.source_text("k.cu")
    assert text == ('#include <cuda_bf16.h>\n'
                    '#line 1 "a.cuh"\n\n#line 1 "b.cuh"\n\nint b;\n\n#line 3 "a.cuh"\nint a;\n'
                    '\n#line 3 "k.cu"\n'
                    '\nint k;\n')
    (tmp_path / "bad.cu").write_text('#include "missing.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r"missing\.cuh"):
        cuda_build.source_text("bad.cu")


def test_pdl_sources_are_the_decode_steps_kernels() -> None:
    assert PDL_SOURCES == ["activation.cu", "decode_attention.cu", "fp8_linear.cu",
                           "gated_delta.cu", "gated_norm.cu", "gated_rope_cache.cu",
                           "gguf_gemv_small.cu", "gguf_quant.cu", "moe.cu", "norm.cu",
                           "rope_cache.cu", "shared_expert.cu", "skinny_fused.cu",
                           "skinny_gemm.cu"]
    for source in PDL_SOURCES:
        assert cuda_build.pdl_kernel_patterns(source), f"{source} includes pdl.cuh, declares none"
        assert f'#include "{HEADER}"' not in cuda_build.source_text(source)


# --- machine code: nvcc (and cuobjdump) --------------------------------------------

def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").is_file() else None


@dataclass(frozen=True)
class Built:
    """One source's PTX text and cubin from a single nvcc run."""

    ptx: str
    cubin: Path


def _build(nvcc: str, source: str, out_dir: Path) -> tuple[str, Built]:
    """nvcc's cubin of source, keeping its intermediate PTX: one front-end
    pass serves both checks (compiling twice cost the suite ~10 s)."""
    keep = out_dir / source
    keep.mkdir()
    cubin = keep / f"{source}.cubin"
    result = subprocess.run(
        [nvcc, "-arch=sm_90", "-std=c++17", "--cubin", "-keep", "-keep-dir", str(keep),
         "-I", str(CSRC), str(CSRC / source), "-o", str(cubin)], capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc failed on {source}:\n{result.stderr}"
    return source, Built((keep / source.replace(".cu", ".ptx")).read_text(), cubin)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    out_dir = tmp_path_factory.mktemp("pdl_build")
    with ThreadPoolExecutor(len(PDL_SOURCES)) as pool:
        return dict(pool.map(lambda s: _build(nvcc, s, out_dir), PDL_SOURCES))


@pytest.fixture(scope="module")
def ptx(built: dict[str, Built]) -> dict[str, str]:
    return {source: result.ptx for source, result in built.items()}


def _ptx_entries(text: str) -> dict[str, str]:
    parts = re.split(r"\.visible \.entry (\w+)\(", text)[1:]
    return dict(zip(parts[::2], parts[1::2], strict=True))


@pytest.mark.parametrize("source", PDL_SOURCES)
def test_declared_kernels_compile_with_both_instructions(ptx: dict[str, str],
                                                        source: str) -> None:
    entries = _ptx_entries(ptx[source])
    for glob in cuda_build.pdl_kernel_patterns(source):
        assert any(cuda_build.declared_pdl_aware(source, name) for name in entries), \
            f"{source}: '{glob}' names no kernel"
    aware = [name for name in entries if cuda_build.declared_pdl_aware(source, name)]
    for name in aware:
        assert "griddepcontrol.wait;" in entries[name], f"{name} never waits"
        assert "griddepcontrol.launch_dependents;" in entries[name], name


def test_pasted_source_compiles_without_the_include_path(tmp_path: Path) -> None:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    (tmp_path / "activation.cu").write_text(cuda_build.source_text("activation.cu"))
    result = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "--ptx",
                             str(tmp_path / "activation.cu"), "-o", str(tmp_path / "a.ptx")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "griddepcontrol.wait;" in (tmp_path / "a.ptx").read_text()


def test_leaves_before_wait_flags_an_exit_or_a_jump_past_the_wait() -> None:
    sass = ("\t\tFunction : good\n"
            "        /*0000*/              @!P0 BRA 0x20 ;\n"
            "        /*0010*/                   CCTL.E.PF2 [R6] ;\n"
            "        /*0020*/                   ACQBULK ;\n"
            "        /*0030*/               @P1 EXIT ;\n"
            "\t\tFunction : exits\n"
            "        /*0000*/               @P1 EXIT ;\n"
            "        /*0010*/                   ACQBULK ;\n"
            "\t\tFunction : jumps\n"
            "        /*0000*/              @!P0 BRA 0x30 ;\n"
            "        /*0010*/                   ACQBULK ;\n"
            "        /*0020*/                   LDG.E R4, desc[UR4][R2.64] ;\n"
            "        /*0030*/                   EXIT ;\n"
            "\t\tFunction : never\n"
            "        /*0000*/                   EXIT ;\n")
    assert leaves_before_wait(sass) == {"good": None, "exits": "EXIT", "jumps": "BRA 0x30"}


def test_checker_flags_a_load_before_the_wait() -> None:
    sass = ("\t\tFunction : good\n"
            "        /*0000*/                   LDC R1, c[0x0][0x28] ;\n"
            "        /*0010*/                   CCTL.E.PF2 [R6] ;\n"
            "        /*0020*/                   ACQBULK ;\n"
            "        /*0030*/              @P0 LDG.E.128 R4, desc[UR4][R2.64] ;\n"
            "\t\tFunction : early\n"
            "        /*0000*/               @!P1 LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;\n"
            "        /*0010*/                   ACQBULK ;\n"
            "\t\tFunction : never\n"
            "        /*0000*/                   STG.E [R2.64], R4 ;\n")
    assert first_global_access_before_wait(sass) == {
        "good": None, "early": "LDG.E.128.CONSTANT", "never": "no wait"}


def test_declared_kernels_wait_before_touching_global_memory(built: dict[str, Built],
                                                            ptx: dict[str, str]) -> None:
    cuobjdump = cuobjdump_path()
    if cuobjdump is None:
        pytest.skip("needs cuobjdump")
    early_by_kernel: dict[str, str | None] = {}
    leaving: dict[str, str | None] = {}
    def dump(result: Built) -> str:
        return subprocess.run([cuobjdump, "-sass", str(result.cubin)], check=True,
                              capture_output=True, text=True).stdout

    with ThreadPoolExecutor(len(built)) as pool:
        listings = dict(zip(built, pool.map(dump, built.values()), strict=True))
    for source, sass in listings.items():
        leaving.update((name, left) for name, left in leaves_before_wait(sass).items()
                       if cuda_build.declared_pdl_aware(source, name))
        found = first_global_access_before_wait(sass)
        aware = {name: early for name, early in found.items()
                 if cuda_build.declared_pdl_aware(source, name)}
        # Every declared kernel of the source's PTX is inspected here, and
        # each source declares some (test_declared_kernels_compile_...).
        declared = {name for name in _ptx_entries(ptx[source])
                    if cuda_build.declared_pdl_aware(source, name)}
        assert set(aware) == declared, f"{source}: {sorted(declared ^ set(aware))}"
        early_by_kernel.update(aware)
    assert all(early is None for early in early_by_kernel.values()), \
        {name: early for name, early in early_by_kernel.items() if early is not None}
    # ... and no thread of them leaves before it waits.
    assert leaving.keys() == early_by_kernel.keys()
    assert all(left is None for left in leaving.values()), \
        {name: left for name, left in leaving.items() if left is not None}
