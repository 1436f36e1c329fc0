"""The dependency direction of docs/architecture.md, enforced.

router/ never imports engine/, kernels/, torch or cupy; protocol/ and kernels/
import nothing of the project. Checked statically (every import statement,
including ones inside functions) and at run time (what importing the router
really loads).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"router", "engine", "protocol", "kernels", "tests"}
FORBIDDEN = {
    "router": {"engine", "kernels", "torch", "cupy", "tests"},
    "protocol": PROJECT - {"protocol"} | {"torch", "cupy"},
    "kernels": PROJECT - {"kernels"},
    "engine": {"router", "tests"},
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_static_imports_follow_the_dependency_direction(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_starting_the_router_loads_no_torch_and_no_engine() -> None:
    code = (
        "import sys, router.cli, router.server, router.app, router.text.model_text;"
        "bad = [m for m in ('torch', 'cupy', 'engine', 'kernels', 'numpy', 'transformers') if m in sys.modules];"
        "print(','.join(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "", f"importing the router loaded: {done.stdout.strip()}"
