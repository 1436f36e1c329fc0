"""The router's settings, parsed once from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from protocol import EngineOptions


@dataclass(frozen=True)
class SamplingOverrides:
    """Server-wide sampling defaults from the command line (llama.cpp's --temp,
    --top-k, --top-p, --min-p); a request's own values still win."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Exactly one of model / models_dir is set.
    model: Path | None = None
    models_dir: Path | None = None
    # Loaded models at most; 0 means no limit.
    models_max: int = 4
    engine: EngineOptions = field(default_factory=EngineOptions)
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    # Seconds an engine may take to load before the load counts as failed.
    load_timeout: float = 600.0
    # Seconds a request waits for a loaded model to become free when every
    # slot under models_max is busy.
    room_timeout: float = 60.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if (self.model is None) == (self.models_dir is None):
            raise ValueError("serve one MODEL or a --models-dir, not both or neither")
        if self.models_max < 0:
            raise ValueError("--models-max must be 0 (no limit) or more")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be 1..65535, got {self.port}")
