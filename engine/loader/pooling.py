"""Which pooling a checkpoint names for its embeddings, read from its own files.

A Hugging Face directory says it in its sentence-transformers configuration:
modules.json lists a `sentence_transformers.models.Pooling` module whose
folder (usually 1_Pooling/) holds a config.json with one pooling_mode_* flag
set (Qwen3-Embedding: pooling_mode_lasttoken). A GGUF file says it in
`<arch>.pooling_type` (llama.cpp's enum: 1 mean, 2 CLS, 3 last). Modes this
engine does not compute (max, weighted mean, sqrt-length mean, llama.cpp's
none and rank) are reported and left to the default.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from protocol import Pooling

log = logging.getLogger(__name__)

# sentence-transformers' flags, in the order its Pooling module reads them.
_ST_FLAGS: dict[str, Pooling | None] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
    "pooling_mode_lasttoken": "last",
}
# Newer sentence-transformers also write the mode by name.
_ST_NAMES: dict[str, Pooling] = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
# llama.cpp's llama_pooling_type.
_GGUF_TYPES: dict[int, Pooling] = {1: "mean", 2: "cls", 3: "last"}
# What a causal decoder without a setting of its own gets: its last token has
# seen the whole input (Qwen3-Embedding, E5-Mistral and the like pool so).
DEFAULT_POOLING: Pooling = "last"


def sentence_transformers_pooling(directory: Path) -> Pooling | None:
    """The pooling a sentence-transformers model directory names, if any."""
    modules = _read_json(directory / "modules.json")
    if not isinstance(modules, list):
        return None
    folder = next((m.get("path") for m in modules if isinstance(m, dict)
                   and str(m.get("type", "")).endswith("models.Pooling")), None)
    if not isinstance(folder, str):
        return None
    config = _read_json(directory / folder / "config.json")
    if not isinstance(config, dict):
        return None
    name = config.get("pooling_mode")
    if isinstance(name, str):
        found = _ST_NAMES.get(name)
        if found is None:
            log.warning("%s: pooling mode %r is not supported (mean, cls and lasttoken are)",
                        directory, name)
        return found
    modes = [flag for flag in _ST_FLAGS if config.get(flag) is True]
    if len(modes) != 1 or _ST_FLAGS[modes[0]] is None:
        log.warning("%s/%s/config.json sets %s; only one of pooling_mode_mean_tokens, "
                    "pooling_mode_cls_token or pooling_mode_lasttoken is supported",
                    directory, folder, ", ".join(modes) or "no pooling mode")
        return None
    return _ST_FLAGS[modes[0]]


def gguf_pooling(pooling_type: Any) -> Pooling | None:
    """The pooling of a GGUF file's `<arch>.pooling_type` value (None: unset)."""
    if pooling_type is None:
        return None
    found = _GGUF_TYPES.get(int(pooling_type))
    if found is None:
        log.warning("GGUF pooling_type %s is not supported (1 mean, 2 cls, 3 last are)",
                    pooling_type)
    return found


def choose_pooling(configured: str | None, own: Pooling | None) -> tuple[Pooling, str]:
    """(the pooling embedding requests get, why): --pooling, else the
    checkpoint's own, else the default for causal decoders."""
    if configured:
        return configured, "--pooling"  # type: ignore[return-value]
    if own is not None:
        return own, "the model's own configuration"
    return DEFAULT_POOLING, "the default for causal decoders"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
