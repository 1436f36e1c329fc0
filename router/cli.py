"""`roundhouse serve` and `roundhouse fetch-default`.

Router-wide options become ServeConfig fields; per-model options (the table
in router/options.py) go to `cli_model_options`, and only those the command
line really gave, because they override the preset. Every start-up error,
a bad flag included, exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from router import env
from router.config import ServeConfig
from router.http.cors import origins
from router.http.host_check import allowed_host
from router.media.limits import MediaLimits
from router.observability.logging_setup import configure_logging
from router.options import OptionValueError, add_arguments, given_options, names

LOG_LEVELS = ("debug", "info", "warning", "error")
# The media flags' defaults are MediaLimits' own.
_MEDIA = MediaLimits()


class CommandLineError(ValueError):
    """A command line that cannot be served; the message says why."""


class _Parser(argparse.ArgumentParser):
    # argparse exits with status 2 on a bad flag; we raise instead, so that
    # callers can test a command line and main() can exit 1 like any start-up
    # failure.
    def error(self, message: str) -> NoReturn:
        raise CommandLineError(message)


def _alias_list(text: str) -> tuple[str, ...]:
    try:
        return names(text)
    except OptionValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device_list(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected GPU indexes separated by commas (0,1), "
                                         f"got {text!r}")
    return tuple(int(part) for part in parts)


def _origin_list(text: str) -> tuple[str, ...]:
    try:
        return origins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_name(text: str) -> str:
    try:
        return allowed_host(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: a unit file's `--max-con 4` would silently mean
    # --max-concurrency today and become an error when another flag shares the prefix.
    parser = _Parser(prog="roundhouse", description="Serve large language models over HTTP.",
                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve one model or a catalog of models over HTTP",
                           allow_abbrev=False,
                           description="Serve one model, or a router over --models-dir "
                                       "and/or --models-preset.")
    serve.add_argument("model", nargs="?", type=Path, metavar="MODEL",
                       help="a .gguf file, a Hugging Face directory, or a directory with one "
                            ".gguf; omitted (with no --models-dir or --models-preset): the "
                            "default model, SmolLM2-135M-Instruct")
    serve.add_argument("--models-dir", type=Path, metavar="DIR",
                       help="serve every model in this directory")
    serve.add_argument("--models-preset", type=Path, metavar="FILE",
                       help="an INI preset of models and their options (docs/presets.md)")
    serve.add_argument("--models-max", type=int, default=4, metavar="N",
                       help="models loaded at once (0: no limit); the least recently used "
                            "idle one makes room (default: 4)")
    serve.add_argument("--devices", type=_device_list, default=None, metavar="0,1",
                       help="the GPUs models are placed on, as CUDA numbers them (default: "
                            "every visible GPU)")
    serve.add_argument("--device-headroom-mib", type=int, default=1024, metavar="MIB",
                       help="device memory the planner leaves free on each GPU (default: 1024)")
    serve.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=True,
                       help="load a requested model that is not loaded (default: on)")
    serve.add_argument("--pending-timeout-ms", type=int, default=60_000, metavar="MS",
                       help="how long a request may wait for its model's seat (room under "
                       "--models-max and in device memory) and a lane (default: 60000)")
    serve.add_argument("--shutdown-grace-seconds", type=float, default=30.0, metavar="S",
                       help="on SIGTERM/SIGINT, time running requests get to finish while new "
                            "ones get 503; the rest then end with an error (default: 30)")
    serve.add_argument("--alias", type=_alias_list, default=(), metavar="A,B",
                       help="other names for a single MODEL")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    serve.add_argument("--port", type=int, default=8080, help="default: 8080")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="default: info")
    serve.add_argument("--webui", action=argparse.BooleanOptionalAction, default=True,
                       help="serve the chat and models page at / (default: on; docs/webui.md)")
    serve.add_argument("--response-store-max-records", type=int, default=10_000, metavar="N",
                       help="Responses API responses kept for previous_response_id and GET, "
                            "least recently used dropped first (default: 10000)")
    serve.add_argument("--response-store-max-mib", type=float, default=512.0, metavar="MIB",
                       help="memory those stored responses may take, in MiB (default: 512)")
    security = serve.add_argument_group("security and admission")
    security.add_argument("--api-key", action="append", default=[], metavar="KEY",
                          help="an API key clients must send (repeat for more); keys also come "
                               f"from ${env.API_KEY} (comma-separated) and --api-key-file")
    security.add_argument("--api-key-file", type=Path, metavar="PATH",
                          help="one key per line, optionally `label: key`; # comments; must not be "
                               "readable by group or others; re-read when it changes")
    security.add_argument("--metrics-open", action="store_true", help="serve /metrics without a key")
    security.add_argument("--cors", action="store_true",
                          help="let web pages of any origin call the API (--cors-origins '*')")
    security.add_argument("--cors-origins", type=_origin_list, default=(), metavar="A,B",
                          help="let web pages of these origins (https://app.example.com) call "
                               "the API; '*': any")
    security.add_argument("--allowed-host", action="append", type=_host_name, default=[],
                          metavar="HOST",
                          help="a Host header to accept besides localhost and loopback "
                               "addresses (repeat for more; '*': any); see docs/security.md")
    security.add_argument("--max-request-mib", type=float, default=64.0, metavar="MIB",
                          help="largest request body (default: 64)")
    security.add_argument("--max-pending-requests", type=int, default=128, metavar="N",
                          help="generation requests that may wait per model beyond its lanes "
                               "(default: 128); more get 429")
    security.add_argument("--max-token-count-requests", type=int, default=64, metavar="N",
                          help="token-counting requests served at once (default: 64)")
    security.add_argument("--default-max-tokens", type=int, default=0, metavar="N",
                          help="output budget for requests that name none (default: 0, one "
                               "lane's share of the KV pool)")
    security.add_argument("--max-choices", type=int, default=16, metavar="N",
                          help="choices one OpenAI request may generate: n (or best_of) "
                               "times its prompts (default: 16); more get 400")
    connections = serve.add_argument_group("connections")
    connections.add_argument("--http-header-timeout-ms", type=int, default=10_000, metavar="MS",
                             help="time a client has to send a request's headers (default: "
                                  "10000)")
    connections.add_argument("--http-body-timeout-ms", type=int, default=60_000, metavar="MS",
                             help="time a client has to send a request's body once its headers "
                                  "are in (default: 60000); slower bodies get 408")
    connections.add_argument("--http-keepalive-timeout-ms", type=int, default=15_000,
                             metavar="MS", help="idle keep-alive connections are closed after "
                                                "this (default: 15000)")
    connections.add_argument("--max-connections", type=int, default=1024, metavar="N",
                             help="client connections open at once; more are refused "
                                  "(default: 1024)")
    logs = serve.add_argument_group("logs")
    logs.add_argument("--request-log-jsonl", type=Path, metavar="FILE",
                      help="write one JSON object per request event (docs/observability.md)")
    logs.add_argument("--request-log-max-mib", type=float, default=100.0, metavar="MIB",
                      help="rotate the request log at this size (default: 100)")
    logs.add_argument("--request-log-keep", type=int, default=5, metavar="N",
                      help="rotated request logs kept (default: 5)")
    logs.add_argument("--log-stats-interval-ms", type=int, default=10_000, metavar="MS",
                      help="period of the throughput line on stderr (default: 10000; 0: off)")
    media = serve.add_argument_group("images in requests (models served with --vision)")
    media.add_argument("--media-max-bytes", type=int, default=_MEDIA.max_image_bytes,
                       metavar="BYTES", help="largest encoded image, from a data: URI or a URL "
                                             f"(default: {_MEDIA.max_image_bytes})")
    media.add_argument("--media-fetch-timeout", type=float, default=_MEDIA.fetch_timeout_s,
                       metavar="S", help="seconds one image URL may take to fetch, redirects "
                                         f"included (default: {_MEDIA.fetch_timeout_s:g})")
    media.add_argument("--media-max-images", type=int, default=_MEDIA.max_images, metavar="N",
                       help=f"images one request may carry (default: {_MEDIA.max_images})")
    media.add_argument("--media-max-image-tokens", type=int, default=_MEDIA.max_image_tokens,
                       metavar="N", help="vision tokens the images of one request may take "
                                         f"together (default: {_MEDIA.max_image_tokens})")
    media.add_argument("--media-allow-private-urls", action="store_true",
                       help="fetch image URLs that resolve to private, loopback or link-local "
                            "addresses (default: refused, so that a request cannot reach into "
                            "the server's network; docs/vision.md)")
    add_arguments(serve)
    sub.add_parser("fetch-default", help="download the default model into the cache and print its path")
    return parser


def config_from_args(args: argparse.Namespace, default_model: Callable[[], Path]) -> ServeConfig:
    model_options = given_options(args)
    model = args.model
    if model is None and args.models_dir is None and args.models_preset is None:
        from router.default_model import DEFAULT_MODEL_TEMPERATURE

        model = default_model()
        # The default model is served greedy unless --temp says otherwise
        # (router/default_model.py says why).
        model_options.setdefault("temp", DEFAULT_MODEL_TEMPERATURE)
    if args.alias and model is None:
        raise CommandLineError("--alias is for a single MODEL; in a router, "
                               "give each model's aliases in the preset (alias = a, b)")
    try:
        return ServeConfig(
            host=args.host,
            port=args.port,
            model=model,
            models_dir=args.models_dir,
            models_preset=args.models_preset,
            models_max=args.models_max,
            devices=args.devices,
            device_headroom_mib=args.device_headroom_mib,
            autoload=args.models_autoload,
            pending_timeout_ms=args.pending_timeout_ms,
            shutdown_grace_seconds=args.shutdown_grace_seconds,
            log_level=args.log_level,
            cli_model_options=model_options,
            aliases=args.alias,
            response_store_max_records=args.response_store_max_records,
            response_store_max_mib=args.response_store_max_mib,
            api_keys=tuple(args.api_key),
            api_keys_env=env.api_keys_from_environment(),
            api_key_file=args.api_key_file,
            metrics_open=args.metrics_open,
            cors_origins=("*",) if args.cors else args.cors_origins,
            allowed_hosts=tuple(args.allowed_host),
            max_request_mib=args.max_request_mib,
            max_pending_requests=args.max_pending_requests,
            max_token_count_requests=args.max_token_count_requests,
            default_max_tokens=args.default_max_tokens,
            max_choices=args.max_choices,
            http_header_timeout_ms=args.http_header_timeout_ms,
            http_body_timeout_ms=args.http_body_timeout_ms,
            http_keepalive_timeout_ms=args.http_keepalive_timeout_ms,
            max_connections=args.max_connections,
            request_log_jsonl=args.request_log_jsonl,
            request_log_max_mib=args.request_log_max_mib,
            request_log_keep=args.request_log_keep,
            log_stats_interval_ms=args.log_stats_interval_ms,
            webui=args.webui,
            media=_media_limits(args),
            media_allow_private_urls=args.media_allow_private_urls,
        )
    except ValueError as exc:
        raise CommandLineError(str(exc)) from None


def _media_limits(args: argparse.Namespace) -> MediaLimits:
    # Checked here so that the error names the flag, not MediaLimits' field.
    for flag, value in (("--media-max-bytes", args.media_max_bytes),
                        ("--media-fetch-timeout", args.media_fetch_timeout),
                        ("--media-max-images", args.media_max_images),
                        ("--media-max-image-tokens", args.media_max_image_tokens)):
        if not value > 0:
            raise CommandLineError(f"{flag} must be more than 0, got {value:g}")
    return MediaLimits(max_image_bytes=args.media_max_bytes,
                       fetch_timeout_s=args.media_fetch_timeout, max_images=args.media_max_images,
                       max_image_tokens=args.media_max_image_tokens)


def parse_serve_command(argv: Sequence[str],
                        default_model: Callable[[], Path] | None = None) -> ServeConfig:
    """The ServeConfig of `roundhouse serve ...`, given the words after
    `roundhouse` (["serve", "--models-preset", "models.ini", ...]). Runs
    nothing and downloads nothing: without a model, the default model's cache
    path stands in unless `default_model` is given. Raises CommandLineError."""
    args = build_parser().parse_args(list(argv))
    if args.command != "serve":
        raise CommandLineError(f"expected a `serve` command line, got {args.command!r}")
    if default_model is None:
        from router.default_model import default_model_path

        default_model = default_model_path
    return config_from_args(args, default_model)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except CommandLineError as exc:
        return _startup_failed(exc)
    # `2026-11-29 20:27:32.123 INFO message` on stderr (docs/observability.md).
    configure_logging(getattr(args, "log_level", "info"))
    from router.default_model import FetchError, ensure_default_model

    if args.command == "fetch-default":
        try:
            print(ensure_default_model())
        except (FetchError, OSError) as exc:
            return _startup_failed(exc)
        return 0
    try:
        config = config_from_args(args, ensure_default_model)
    except (ValueError, FetchError, OSError) as exc:
        return _startup_failed(exc)
    # serve() builds the catalog before it binds the port; a bad preset or a
    # model whose options do not fit together also exits 1 there.
    from router.server import serve

    return serve(config)


def _startup_failed(exc: Exception) -> int:
    print(f"roundhouse: error: {exc}", file=sys.stderr)
    return 1
