"""`roundhouse serve` and `roundhouse fetch-default`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from protocol import EngineOptions
from router.config import SamplingOverrides, ServeConfig


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve one model or a directory of models over HTTP",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model", nargs="?", type=Path,
                       help="a .gguf file or Hugging Face model directory; "
                            "omitted (and no --models-dir): the default model, SmolLM2-135M-Instruct")
    serve.add_argument("--models-dir", type=Path, help="serve every model in this directory")
    serve.add_argument("--models-max", type=int, default=4,
                       help="models loaded at once (0: no limit); the least recently used idle one is unloaded")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--max-concurrency", type=int, default=8, help="requests decoded together (lanes)")
    serve.add_argument("--max-batched-tokens", type=int, default=512,
                       help="tokens one engine step computes: decode rows plus prefill chunks")
    serve.add_argument("--max-context", type=int, default=0, help="context length (0: the model's)")
    serve.add_argument("--kv-capacity", type=int, default=0, help="KV pool size in tokens (0: automatic)")
    serve.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    serve.add_argument("--threads", type=int, default=0, help="CPU threads per engine (0: torch's default)")
    serve.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")
    serve.add_argument("--temp", type=float, help="default temperature for requests that set none")
    serve.add_argument("--top-k", type=int, help="default top_k for requests that set none")
    serve.add_argument("--top-p", type=float, help="default top_p for requests that set none")
    serve.add_argument("--min-p", type=float, help="default min_p for requests that set none")
    serve.add_argument("--load-timeout", type=float, default=600.0, help="seconds a model may take to load")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_config(args: argparse.Namespace) -> ServeConfig:
    model = args.model
    temperature = args.temp
    if model is None and args.models_dir is None:
        from router.default_model import DEFAULT_MODEL_TEMPERATURE, ensure_default_model

        model = ensure_default_model()
        if temperature is None:
            temperature = DEFAULT_MODEL_TEMPERATURE
    return ServeConfig(
        host=args.host,
        port=args.port,
        model=model,
        models_dir=args.models_dir,
        models_max=args.models_max,
        engine=EngineOptions(
            device=args.device,
            dtype=args.dtype,
            page_size=args.page_size,
            max_concurrency=args.max_concurrency,
            max_batched_tokens=args.max_batched_tokens,
            max_context=args.max_context,
            kv_capacity_tokens=args.kv_capacity,
            threads=args.threads,
            seed=args.seed,
        ),
        sampling=SamplingOverrides(
            temperature=temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p
        ),
        load_timeout=args.load_timeout,
        log_level=args.log_level,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roundhouse", description="Serve large language models over HTTP.")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("fetch-default", help="download the default model into the cache and print its path")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command == "fetch-default":
        from router.default_model import ensure_default_model

        print(ensure_default_model())
        return 0
    try:
        config = build_config(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    from router.server import serve

    return serve(config)
