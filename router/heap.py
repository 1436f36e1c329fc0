"""Keeping the garbage collector's full collections short.

A full (generation 2) collection walks every container object the process
holds; measured on the H200 host while 64 streams ran, the router's took 20-25
ms and an engine's 20-70 ms, and every stream stalled for that long (the p99
inter-token latency, docs/performance.md). Objects that live as long as the
process (imported modules, the app, a loaded model's text state) need never
be walked: gc.freeze() moves what exists now out of the collector's sight,
so later collections only walk what was made since. Frozen objects that
later become cyclic garbage are never reclaimed, which is why this runs at
moments when what exists is long-lived: startup, and a model's load.
"""

from __future__ import annotations

import gc


def freeze_long_lived(*, collect_first: bool) -> None:
    """Hide the objects that exist now from later collections. collect_first:
    collect cyclic garbage before (a full collection: only where nothing is
    streaming yet)."""
    if collect_first:
        gc.collect()
    gc.freeze()
