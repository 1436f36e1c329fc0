"""A model directory that fails where a real broken download would: in the
engine, after the router has read its tokenizer and started the process."""

from __future__ import annotations

import json
from pathlib import Path

UNKNOWN_ARCHITECTURE = "NoSuchModelForCausalLM"


def write_broken_model(target: Path, source: Path) -> Path:
    """Copy of the Hugging Face model at source whose config names an
    architecture the engine does not know."""
    target.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = [UNKNOWN_ARCHITECTURE]
    (target / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (target / name).symlink_to(source / name)
    return target
