"""Readers of `cuobjdump -sass` listings for the PDL-aware kernels'
machine code (tests/kernels/test_pdl.py): where a kernel's first
griddepcontrol.wait (SASS ACQBULK) falls against its global memory
accesses and its exits."""

from __future__ import annotations

import re
import shutil
from pathlib import Path


def cuobjdump_path() -> str | None:
    """cuobjdump on the PATH, else the one triton bundles."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(candidate) if candidate.is_file() else None


# One SASS instruction's opcode (after its address and optional predicate).
_SASS_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
# Accesses to global (or generic) memory; LDC/LDS/STS/LDL/STL and the L2
# prefetch (CCTL) are not.
_GLOBAL_ACCESS = re.compile(
    r"(LDG|STG|LD|ST|ATOMG|ATOM|RED|REDG|LDGSTS|SULD|SUST|UTMA\w*|UBLKCP\w*)(\.|$)")


def first_global_access_before_wait(sass: str) -> dict[str, str | None]:
    """Per kernel of a `cuobjdump -sass` listing: the first global memory
    access before its first ACQBULK (griddepcontrol.wait), "no wait" when
    it has none, None when the wait comes first."""
    found: dict[str, str | None] = {}
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split()[0]
        opcodes = [m.group(1) for m in _SASS_OPCODE.finditer(chunk)]
        if "ACQBULK" not in opcodes:
            found[name] = "no wait"
            continue
        early = [op for op in opcodes[:opcodes.index("ACQBULK")] if _GLOBAL_ACCESS.match(op)]
        found[name] = early[0] if early else None
    return found


# A SASS instruction's address, opcode and operands (up to the ';').
_SASS_INSTRUCTION = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")


def leaves_before_wait(sass: str) -> dict[str, str | None]:
    """Per kernel of a `cuobjdump -sass` listing that has an ACQBULK: the
    first instruction before its first ACQBULK that lets a thread leave
    without waiting (an EXIT, or a branch past the wait), None if none
    does. A thread that returns before griddepcontrol.wait lets the grid
    complete before its predecessor (kernels/csrc/pdl.cuh). By address: a
    branch before the wait to a target after it is the early-return shape."""
    found: dict[str, str | None] = {}
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split()[0]
        code = [(int(m.group(1), 16), m.group(2), m.group(3))
                for m in _SASS_INSTRUCTION.finditer(chunk)]
        waits = [address for address, opcode, _ in code if opcode == "ACQBULK"]
        if not waits:
            continue
        found[name] = None
        for address, opcode, operands in code:
            if address >= waits[0]:
                break
            target = _BRANCH_TARGET.search(operands)
            if opcode.startswith("EXIT") or (opcode.startswith("BRA") and target is not None
                                             and int(target.group(1), 16) > waits[0]):
                found[name] = f"{opcode}{operands}".strip()
                break
    return found
