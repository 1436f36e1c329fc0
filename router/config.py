"""The router's own settings, parsed once from the command line."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.media.limits import MediaLimits


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
    # The GPUs the router places models on (CUDA ordinals as engines see
    # them); None: every GPU visible (router/devices.py).
    devices: tuple[int, ...] | None = None
    # Device memory (MiB) the planner keeps free on each GPU.
    device_headroom_mib: int = 1024
    # Load a requested model that is not loaded (per request: ?autoload=0|1).
    autoload: bool = True
    # How long a request may wait for its model's seat (room under models_max and
    # device memory) and a lane.
    pending_timeout_ms: int = 60_000
    # After SIGTERM/SIGINT: how long running requests may go on finishing
    # before they are ended with an error (new ones get 503 meanwhile).
    shutdown_grace_seconds: float = 30.0
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
    # ---- security and admission (docs/security.md, docs/serving.md) ----
    # API keys from --api-key (labels cli-1, cli-2, ...) and the
    # ROUNDHOUSE_API_KEY environment variable (env-1, ...); --api-key-file
    # adds file-<label> keys and is re-read when it changes.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_env: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: Path | None = None
    # /metrics without a key.
    metrics_open: bool = False
    # Origins whose pages may call the API from a browser (--cors-origins;
    # "*" is any origin, which --cors means). Empty: no CORS at all.
    cors_origins: tuple[str, ...] = ()
    # Host header values accepted besides the loopback names (--allowed-host;
    # router/http/host_check.py): DNS-rebinding protection.
    allowed_hosts: tuple[str, ...] = ()
    # Request bodies above this are refused before parsing (413).
    max_request_mib: float = 64.0
    # Generation requests that may wait per model beyond its lanes; past it, 429.
    max_pending_requests: int = 128
    # Token-counting requests (count_tokens, input_tokens, /tokenize,
    # /apply-template) served at once; past it, 429.
    max_token_count_requests: int = 64
    # Output budget for requests that name none; 0 means one lane's share of
    # the KV pool, clamped to the remaining context.
    default_max_tokens: int = 0
    # Choices one OpenAI request may generate: n (or best_of) times its
    # prompts; each is an engine request (router/openai/choices.py).
    max_choices: int = 16
    # ---- connections (docs/serving.md, router/http/connections.py) ----
    # How long a client has to send a request's headers (from the connection's
    # start, or from the first byte of a later request), and then its body.
    http_header_timeout_ms: int = 10_000
    http_body_timeout_ms: int = 60_000
    # How long an idle keep-alive connection stays open after a response.
    http_keepalive_timeout_ms: int = 15_000
    # Client connections open at once; more are refused at once.
    max_connections: int = 1024
    # ---- observability (docs/observability.md) ----
    request_log_jsonl: Path | None = None
    request_log_max_mib: float = 100.0
    request_log_keep: int = 5
    # The periodic throughput line on stderr; 0 turns it off.
    log_stats_interval_ms: int = 10_000
    # The web page at / (docs/webui.md); --no-webui turns it off.
    webui: bool = True
    # ---- images in requests (docs/vision.md) ----
    # Bytes, fetch time, images and vision tokens a request's images may take
    # (--media-max-bytes, --media-fetch-timeout, --media-max-images,
    # --media-max-image-tokens).
    media: MediaLimits = field(default_factory=MediaLimits)
    # --media-allow-private-urls: image URLs may name private, loopback and
    # link-local addresses (off: the SSRF guard of router/media/fetch.py).
    media_allow_private_urls: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and (self.models_dir or self.models_preset):
            raise ValueError("serve one MODEL, or a --models-dir/--models-preset router, not both")
        if self.model is None and self.models_dir is None and self.models_preset is None:
            raise ValueError("nothing to serve: give a MODEL, --models-dir or --models-preset")
        if self.models_max < 0:
            raise ValueError("--models-max must be 0 (no limit) or more")
        if self.device_headroom_mib < 0:
            raise ValueError("--device-headroom-mib must be 0 or more")
        if self.devices is not None and len(set(self.devices)) != len(self.devices):
            raise ValueError("--devices lists a GPU twice")
        if self.pending_timeout_ms < 0:
            raise ValueError("--pending-timeout-ms must be 0 or more")
        if not 0 <= self.shutdown_grace_seconds <= 3600:
            raise ValueError("--shutdown-grace-seconds must be 0..3600")
        if self.response_store_max_records < 1:
            raise ValueError("--response-store-max-records must be 1 or more")
        if not self.max_request_mib > 0:
            raise ValueError("--max-request-mib must be more than 0")
        if self.max_pending_requests < 0 or self.max_token_count_requests < 1:
            raise ValueError("--max-pending-requests must be 0 or more and "
                             "--max-token-count-requests at least 1")
        if self.default_max_tokens < 0:
            raise ValueError("--default-max-tokens must be 0 (one lane's share) or more")
        if self.max_choices < 1:
            raise ValueError("--max-choices must be 1 or more")
        if not self.request_log_max_mib > 0 or self.request_log_keep < 1:
            raise ValueError("--request-log-max-mib must be more than 0 and --request-log-keep at least 1")
        if self.log_stats_interval_ms < 0:
            raise ValueError("--log-stats-interval-ms must be 0 (off) or more")
        if not self.response_store_max_mib > 0:
            raise ValueError("--response-store-max-mib must be more than 0")
        for flag, ms in (("--http-header-timeout-ms", self.http_header_timeout_ms),
                         ("--http-body-timeout-ms", self.http_body_timeout_ms),
                         ("--http-keepalive-timeout-ms", self.http_keepalive_timeout_ms)):
            if ms < 1:
                raise ValueError(f"{flag} must be 1 or more")
        if self.max_connections < 1:
            raise ValueError("--max-connections must be 1 or more")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be 1..65535, got {self.port}")

    @property
    def cors(self) -> bool:
        """Whether CORS is on at all (--cors or --cors-origins)."""
        return bool(self.cors_origins)

    @property
    def is_router(self) -> bool:
        return self.model is None
