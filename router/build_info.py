"""The build's fingerprint, in llama.cpp's form.

llama.cpp reports `b<build number>-<commit>` (e.g. `b6123-1f2e3d4`) as
`build_info` in /props and as `system_fingerprint` in OpenAI objects; clients
show it and compare it across responses to notice a server upgrade. Ours is
`b<package version>-roundhouse`: the same shape, and it changes exactly when
the installed release does.
"""

from __future__ import annotations

import importlib.metadata
from functools import cache


@cache
def build_fingerprint() -> str:
    try:
        version = importlib.metadata.version("roundhouse")
    except importlib.metadata.PackageNotFoundError:
        # Run from a source tree that was never installed.
        version = "0.0.0"
    return f"b{version}-roundhouse"
