"""The router's own settings, parsed once from the command line."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # A single-model server sets `model`; a router sets models_dir and/or
    # models_preset.
    model: Path | None = None
    models_dir: Path | None = None
    models_preset: Path | None = None
    # Models holding device memory at once (loaded, loading, waking,
    # unloading); 0 means no limit. Sleeping models do not count.
    models_max: int = 4
    # Load a requested model that is not loaded (per request: ?autoload=0|1).
    autoload: bool = True
    # How long a request may wait for a model slot (room under models_max).
    pending_timeout_ms: int = 60_000
    log_level: str = "info"
    # Per-model options given on the command line, by option name
    # ("max-context": 4096), already parsed; they win over the preset.
    cli_model_options: Mapping[str, Any] = field(default_factory=dict)
    # Aliases of a single-model server's model (--alias).
    aliases: tuple[str, ...] = ()
    # Bounds of the in-process store of Responses API responses
    # (previous_response_id, GET /v1/responses/{id}); least recently used go first.
    response_store_max_records: int = 10_000
    response_store_max_mib: float = 512.0

    def __post_init__(self) -> None:
        if self.model is not None and (self.models_dir or self.models_preset):
            raise ValueError("serve one MODEL, or a --models-dir/--models-preset router, not both")
        if self.model is None and self.models_dir is None and self.models_preset is None:
            raise ValueError("nothing to serve: give a MODEL, --models-dir or --models-preset")
        if self.models_max < 0:
            raise ValueError("--models-max must be 0 (no limit) or more")
        if self.pending_timeout_ms < 0:
            raise ValueError("--pending-timeout-ms must be 0 or more")
        if self.response_store_max_records < 1:
            raise ValueError("--response-store-max-records must be 1 or more")
        if not self.response_store_max_mib > 0:
            raise ValueError("--response-store-max-mib must be more than 0")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be 1..65535, got {self.port}")

    @property
    def is_router(self) -> bool:
        return self.model is None
