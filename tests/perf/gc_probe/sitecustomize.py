"""Logs every garbage-collector pause of this Python process (a diagnostic).

Put this folder first on PYTHONPATH and set ROUNDHOUSE_GC_PROBE to a folder:
each process (router, engines) appends one JSON line per collection longer
than 1 ms to <folder>/gc-<pid>.jsonl: generation, milliseconds, objects
collected. tests/perf/bench_gpu_http.py --gc-probe does this for a run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

_FOLDER = os.environ.get("ROUNDHOUSE_GC_PROBE")

if _FOLDER:
    os.makedirs(_FOLDER, exist_ok=True)
    _started: list[float] = [0.0]
    _path = os.path.join(_FOLDER, f"gc-{os.getpid()}.jsonl")
    _argv = " ".join(sys.argv[:3])

    def _probe(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - _started[0]) * 1e3
        if ms >= 1.0:
            with open(_path, "a") as log:
                log.write(json.dumps({"argv": _argv, "generation": info["generation"],
                                      "ms": round(ms, 2), "collected": info["collected"],
                                      "at": time.time()}) + "\n")

    gc.callbacks.append(_probe)
