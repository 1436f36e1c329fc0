"""kernels/csrc/gguf_quant.cu's Hopper machine code, checked without a GPU.

ptxas 13.0 for sm_90 turned the GEMV's cp.async with an L2::cache_hint into
`LDGSTS [Ra + URn], desc[URn+1]` with n encoded as 0 in some loops: the copy
read UR0/UR1, which the kernel never writes, and the H200 faulted with
CUDA_ERROR_ILLEGAL_INSTRUCTION (Q6_K, and every type's 9..16-row kernel). A
uniform register that is read but written nowhere in its kernel is that bug's
signature, so the test compiles the module as NVRTC does (sm_90, -ftz=true,
which CuPy adds) and looks for one. Skipped where nvcc or cuobjdump is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).parents[2] / "kernels" / "csrc" / "gguf_quant.cu"
SMALL_SOURCE = SOURCE.with_name("gguf_gemv_small.cu")

# One SASS instruction: optional predicate, opcode, operands up to ';'.
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(\S+)\s*([^;]*);")
_UNIFORM = re.compile(r"\bUR(\d+)\b")


def _tool(name: str) -> str | None:
    """A CUDA binary tool: on PATH, next to nvcc, or the copy Triton ships."""
    found = shutil.which(name)
    if found:
        return found
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).resolve().parent / name] if nvcc else []
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    return next((str(c) for c in candidates if c.is_file()), None)


def unwritten_uniform_reads(sass: str) -> dict[str, list[str]]:
    """Per kernel of a `cuobjdump -sass` listing, the instructions that read a
    uniform register (URn) that no instruction of that kernel writes."""
    found: dict[str, list[str]] = {}
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split()[0]
        written: set[int] = set()
        reads: list[tuple[int, str]] = []
        for line in chunk.splitlines():
            match = _INSTRUCTION.match(line)
            if match is None:
                continue
            opcode, operands = match.groups()
            parts = [p.strip() for p in operands.split(",")]
            dest = re.fullmatch(r"UR(\d+)", parts[0]) if parts else None
            if dest is not None:
                written.add(int(dest.group(1)))
                if ".64" in opcode or ".WIDE" in opcode:  # a register pair
                    written.add(int(dest.group(1)) + 1)
                parts = parts[1:]
            for part in parts:
                reads.extend((int(r), match.group(0).strip()) for r in _UNIFORM.findall(part))
        bad = [text for reg, text in reads if reg not in written]
        if bad:
            found[name] = bad
    return found


def test_checker_flags_a_read_of_a_never_written_uniform_register() -> None:
    sass = (
        "\t\tFunction : k\n"
        "        /*0000*/                   UMOV UR8, 0x400 ;\n"
        "        /*0010*/                   ULDC.64 UR4, c[0x0][0x208] ;\n"
        "        /*0020*/                   LDG.E R2, desc[UR4][R2.64] ;\n"
        "        /*0030*/                   LDS R3, [R2+UR5+0x10] ;\n"
        "        /*0040*/              @!P0 LDGSTS.E.BYPASS.128 [R2+UR0], desc[UR1][R8.64] ;\n"
    )
    assert list(unwritten_uniform_reads(sass)) == ["k"]
    assert len(unwritten_uniform_reads(sass)["k"]) == 2  # UR0 and UR1
    assert unwritten_uniform_reads(sass.replace("UR0], desc[UR1]", "UR8], desc[UR5]")) == {}


def hopper_sass(source: Path, tmp_path: Path) -> str:
    """cuobjdump -sass of source compiled as NVRTC does (sm_90, -ftz=true,
    which CuPy adds); skips the test where nvcc or cuobjdump is missing."""
    nvcc, cuobjdump = _tool("nvcc"), _tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    cubin = tmp_path / source.with_suffix(".cubin").name
    subprocess.run(
        [nvcc, "-arch=sm_90", "-std=c++17", "-ftz=true", "-cubin", "-o", str(cubin), str(source)],
        check=True,
        capture_output=True,
    )
    return subprocess.run(
        [cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True
    ).stdout


def functions(sass: str) -> dict[str, str]:
    """Kernel name -> its SASS listing."""
    return {chunk.split()[0]: chunk for chunk in sass.split("Function : ")[1:]}


def test_gemv_kernels_read_only_uniform_registers_they_write(tmp_path: Path) -> None:
    sass = hopper_sass(SOURCE, tmp_path)
    assert sass.count("Function : gguf_gemv_") == 10  # 5 types x 2 row counts
    assert unwritten_uniform_reads(sass) == {}


def test_cuda_core_gemv_machine_code(tmp_path: Path) -> None:
    """gguf_gemv_small.cu: one kernel per type and row count 1..4; the same
    uniform-register check; the batch-1 kernels keep everything in registers
    (no local memory: a spill in the decode loop would cost more than the
    decode); Q4_K/Q5_K load 16 bytes at a time, and no type loads single
    bytes (the 2-byte aligned types read 32-bit words and funnel-shift)."""
    kernels = functions(hopper_sass(SMALL_SOURCE, tmp_path))
    types = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
    assert sorted(kernels) == sorted(f"gguf_gemv_small_{t}_m{m}" for t in types for m in range(1, 5))
    assert unwritten_uniform_reads("".join("Function : " + k for k in kernels.values())) == {}
    for name, code in kernels.items():
        opcodes = [m.group(1) for m in map(_INSTRUCTION.match, code.splitlines()) if m]
        if name.endswith("_m1"):
            assert not [o for o in opcodes if o.startswith(("LDL", "STL"))], f"{name} spills"
        if "_Q4_K_" in name or "_Q5_K_" in name:
            assert sum(o.startswith("LDG.E.128") for o in opcodes) >= 3, name
        assert not [o for o in opcodes if o.startswith("LDG") and (".U8" in o or ".S8" in o)], name
