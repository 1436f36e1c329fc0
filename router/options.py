"""Per-model options: one table, used three ways.

Each option has one name (`max-context`), written `--max-context` on the
command line and `max-context = ...` in a preset. The table builds the
`roundhouse serve` flags, parses preset values, and says where each value
lands in ModelSettings. A model's settings are resolved from layers, lowest
precedence first: built-in defaults <- preset [*] <- the model's section <-
the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import EngineOptions
from protocol.launch import (
    DTYPES,
    EXPERT_RESIDENCIES,
    GGUF_WEIGHTS,
    KV_DTYPES,
    QUANTIZE_KINDS,
    SPEC_KINDS,
)
from router.settings import ModelSettings, SamplingOverrides
from router.text.chat_template import CHATML_TEMPLATE, ChatTemplate, TemplateError
from router.text.model_text import RENDERER_ARGUMENTS


class OptionValueError(ValueError):
    """A value an option cannot take; the message says what it wants."""


Parse = Callable[[str], Any]


def integer(low: int, high: int | None = None) -> Parse:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise OptionValueError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise OptionValueError(f"must be {span}, got {value}")
        return value

    return parse


def number(low: float, high: float | None = None, *, low_open: bool = False) -> Parse:
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise OptionValueError(f"expected a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise OptionValueError(f"must be {_span(low, high, low_open)}, got {text.strip()!r}")
        return value

    return parse


def _span(low: float, high: float | None, low_open: bool) -> str:
    if high is None:
        return f"> {low}" if low_open else f">= {low}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


def power_of_two(text: str) -> int:
    value = integer(1)(text)
    if value & (value - 1):
        raise OptionValueError(f"must be a power of two, got {value}")
    return value


def choice(*values: str) -> Parse:
    def parse(text: str) -> str:
        value = text.strip()
        if value not in values:
            raise OptionValueError(f"must be one of {', '.join(values)}, got {value!r}")
        return value

    return parse


# llama.cpp's presets write flags as true/false, 1/0 or on/off.
_TRUE = frozenset({"true", "1", "on", "yes"})
_FALSE = frozenset({"false", "0", "off", "no"})


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise OptionValueError(f"expected true or false, got {text.strip()!r}")


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def device(text: str) -> str:
    """auto (a GPU when there is one, placed by the router; else the CPU),
    cpu, cuda (any GPU), cuda:N, or a bare GPU index N (llama.cpp's --device
    style), which means cuda:N."""
    value = text.strip()
    if value.isdigit():
        return f"cuda:{int(value)}"
    if not _DEVICE.fullmatch(value):
        raise OptionValueError(f"must be auto, cpu, cuda, cuda:N or a GPU index N, got {value!r}")
    return value


def kv_capacity(text: str) -> int:
    """A token count; `auto` (-1): all the device memory the model is given;
    0: what its lanes can use (the default)."""
    if text.strip().lower() == "auto":
        return -1
    return integer(0)(text)


def host_kv_size(text: str) -> int:
    """MiB of host memory for the prefix cache's host tier; 0: off (the
    default); `auto` (or llama.cpp's -1, "no limit"): the host memory
    available less a reserve. Stored as -1 for auto."""
    value = text.strip().lower()
    if value in ("auto", "-1"):
        return -1
    try:
        return integer(0)(value)
    except OptionValueError:
        raise OptionValueError(f"expected a size in MiB, 0 (off) or auto, got {text.strip()!r}"
                               ) from None


def cpu_moe(text: str) -> str:
    """llama.cpp's --cpu-moe switch as an expert residency: on, every
    layer's experts in host memory; off, on the device."""
    return "host" if boolean(text) else "device"


def directory(text: str) -> str:
    """A directory path, made absolute (engines may run elsewhere); it need
    not exist yet (the engine creates it)."""
    value = text.strip()
    if not value:
        raise OptionValueError("expected a directory path")
    return str(Path(value).expanduser().absolute())


def model_path(text: str) -> str:
    """A model checkpoint (a .gguf file or a model directory) that exists
    now, made absolute (engines may run elsewhere)."""
    value = text.strip()
    if not value:
        raise OptionValueError("expected a model path")
    path = Path(value).expanduser().absolute()
    if not path.exists():
        raise OptionValueError(f"{str(path)!r} does not exist")
    return str(path)


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list of model names (`alias = a, b`)."""
    parts = tuple(part.strip() for part in text.split(","))
    if not any(parts):
        raise OptionValueError("expected one or more names separated by commas")
    if not all(parts):
        raise OptionValueError(f"empty name in {text.strip()!r}")
    for index, part in enumerate(parts):
        if part in parts[:index]:
            raise OptionValueError(f"{part!r} is listed twice")
    return parts


def is_inline_template(text: str) -> bool:
    """llama.cpp's --chat-template takes the template itself: Jinja text, or
    the name chatml."""
    return "{%" in text or "{{" in text or text.strip() == "chatml"


def template_file(text: str) -> str:
    """A Jinja chat template file (or, as llama.cpp allows, the template text
    itself or `chatml`), read and compiled now so that a bad one stops the
    server at start (or a reload) with a message, not a request."""
    if text.strip() == "chatml":
        return CHATML_TEMPLATE
    if is_inline_template(text):
        source = text
        try:
            ChatTemplate(source)
        except TemplateError as exc:
            raise OptionValueError(str(exc)) from None
        return source
    path = Path(text.strip()).expanduser()
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionValueError(f"cannot read the chat template {str(path)!r}: {exc}") from None
    try:
        ChatTemplate(source)
    except TemplateError as exc:
        raise OptionValueError(f"{str(path)!r}: {exc}") from None
    return source


def json_object(text: str) -> str:
    """A JSON object, kept as canonical JSON text (settings must stay hashable)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise OptionValueError(f"expected a JSON object, got {text.strip()!r} ({exc})") from None
    if not isinstance(value, dict):
        raise OptionValueError(f"expected a JSON object, got {text.strip()!r}")
    return json.dumps(value, sort_keys=True)


def template_kwargs(text: str) -> str:
    """Server-wide chat template variables: a JSON object that may not set
    what the server sets from each request (messages, tools, ...)."""
    canonical = json_object(text)
    reserved = sorted(RENDERER_ARGUMENTS & json.loads(canonical).keys())
    if reserved:
        raise OptionValueError(f"may not set {reserved[0]!r}: the server sets it from each "
                               "request")
    return canonical


@dataclass(frozen=True)
class ModelOption:
    name: str
    parse: Parse
    # Where the value lands: a ModelSettings field, or "engine.<field>" /
    # "sampling.<field>" inside its nested structs.
    target: str
    help: str
    metavar: str | None = None
    # A switch: `--model-suspend` / `--no-model-suspend`, `model-suspend = true`.
    flag: bool = False
    # Only a model's own preset section may set it (not [*], not the command line).
    section_only: bool = False
    # A file path: in a preset, relative to the preset's directory.
    is_path: bool = False
    # What --help says the default is, when the default value itself says little.
    default_text: str | None = None

    @property
    def default(self) -> Any:
        # Read from ModelSettings itself, so the table never disagrees with it.
        value: Any = ModelSettings()
        for part in self.target.split("."):
            value = getattr(value, part)
        return value

    @property
    def dest(self) -> str:
        # Prefixed so no per-model option can collide with a router-wide one.
        return "model_" + self.name.replace("-", "_")


OPTIONS: tuple[ModelOption, ...] = (
    ModelOption("device", device, "device",
                "auto (a GPU when there is one, where the model fits best; else the CPU), "
                "cpu, cuda (any GPU), cuda:N or N (pinned to the N-th GPU)", "DEVICE"),
    ModelOption("dtype", choice(*DTYPES), "engine.dtype",
                "weights and activations: auto (float32 on the CPU, bfloat16 on CUDA), "
                "float32, bfloat16 or float16", "DTYPE"),
    ModelOption("page-size", power_of_two, "engine.page_size",
                "tokens per KV page (a power of two)", "N"),
    ModelOption("max-concurrency", integer(1), "engine.max_concurrency",
                "lanes: requests decoded together; more wait in arrival order", "N"),
    ModelOption("max-batched-tokens", integer(1), "engine.max_batched_tokens",
                "tokens one engine step computes (decode rows plus prefill chunks); "
                "at least max-concurrency", "N"),
    ModelOption("max-context", integer(0), "engine.max_context",
                "context length in tokens (0: the model's trained context)", "N"),
    ModelOption("kv-capacity", kv_capacity, "engine.kv_capacity_tokens",
                "KV pool size in tokens; 0 (default): what the lanes can use (max-concurrency "
                "x context + prefix-cache-tokens) within the memory given; auto: all the "
                "memory given", "N|auto"),
    ModelOption("prefix-cache-tokens", integer(0), "engine.prefix_cache_tokens",
                "KV tokens kept beyond what the lanes can use, for cached prompt prefixes", "N"),
    ModelOption("host-kv-mib", host_kv_size, "engine.host_kv_mib",
                "host memory (MiB) for the prefix cache's host tier: KV pages the device "
                "evicts wait there and are copied back when a prompt reuses them (0: off; "
                "auto: the host memory available less max(a quarter of the total, 4 GiB))",
                "MIB|auto"),
    ModelOption("cache-ram", host_kv_size, "engine.host_kv_mib",
                "llama.cpp's name for --host-kv-mib (-1: auto)", "MIB|auto"),
    ModelOption("disk-kv-path", directory, "engine.disk_kv_path",
                "directory for the prefix cache's disk tier: KV pages the host tier evicts "
                "are written there (in a subdirectory per model and KV format), read back "
                "when a prompt reuses them, and found again after a restart; needs "
                "--host-kv-mib and --disk-kv-mib", "DIR", is_path=True, default_text="off"),
    ModelOption("disk-kv-mib", integer(0), "engine.disk_kv_mib",
                "the most the disk tier keeps on disk (MiB; least recently used pages out)",
                "MIB"),
    ModelOption("disk-kv-restore-ms", integer(1), "engine.disk_kv_restore_ms",
                "how long one request may spend reading its pages from the disk tier; the "
                "rest of its prompt is computed", "MS"),
    ModelOption("device-memory-mib", integer(0), "engine.device_memory_mib",
                "GPU memory (MiB) this model may hold in all (weights, KV, activations, "
                "graphs); the planner reserves it and the KV pool fills it "
                "(0: planned from the checkpoint)", "MIB"),
    ModelOption("kv-dtype", choice(*KV_DTYPES), "engine.kv_dtype",
                "how the KV cache stores keys and values: bf16 (the model's dtype) or fp8 "
                "(float8 e4m3, half the bytes: twice the tokens in the same memory; our CUDA "
                "kernels on a bf16 model, or the CPU reference)", "{bf16,fp8}"),
    ModelOption("quantize", choice(*QUANTIZE_KINDS), "engine.quantize",
                "quantize a Hugging Face checkpoint's projection matrices at load: fp8 "
                "(float8 e4m3, 128x128 block scales, about half the weight bytes of bf16; "
                "our CUDA kernels on a bf16 model only; not for GGUF files; FP8 "
                "checkpoints need no option)", "{fp8}", default_text="off"),
    ModelOption("gguf-weights", choice(*GGUF_WEIGHTS), "engine.gguf_weights",
                "how a GGUF file's quantized matrices are served on a GPU: dequantized to "
                "bf16 at load, or packed (kept in their Q8_0/Q4_0/Q4_K/Q5_K/Q6_K blocks, "
                "about the file's bytes on the device; slower than bf16 for now: see "
                "docs/performance.md)", "{dequantized,packed}", default_text="dequantized"),
    ModelOption("vision", boolean, "engine.vision",
                "accept images (Chat Completions image_url, Responses input_image, Anthropic "
                "image blocks, /completion multimodal_data) for a vision-language model; "
                "without it they get 400 vision_disabled (docs/vision.md)", flag=True),
    ModelOption("mmproj", model_path, "engine.mmproj",
                "with --vision: the vision projector GGUF of a GGUF model (llama.cpp's "
                "--mmproj)", "PATH", is_path=True, default_text="none"),
    ModelOption("mm", model_path, "engine.mmproj", "llama.cpp's short name for --mmproj",
                "PATH", is_path=True, default_text="none"),
    ModelOption("deterministic", boolean, "engine.deterministic",
                "batch-invariant mode: a request's tokens are the same alone, in any batch, "
                "in any prompt chunking and after a prefix-cache hit (dense models; slower, "
                "docs/serving.md)", flag=True),
    ModelOption("kv-headroom-mib", integer(0), "engine.kv_headroom_mib",
                "device memory (MiB) that automatic KV sizing leaves free", "MIB"),
    ModelOption("cuda-graph", boolean, "engine.cuda_graph",
                "replay decode steps from CUDA graphs (--no-cuda-graph: run them eagerly)",
                flag=True),
    ModelOption("output-window", integer(0), "engine.output_window",
                "output tokens admission reserves KV for, beyond the prompt", "N"),
    ModelOption("threads", integer(0), "engine.threads",
                "CPU threads per engine (0: torch's default)", "N"),
    ModelOption("pooling", choice("mean", "cls", "last"), "engine.pooling",
                "how /v1/embeddings and /embedding pool a prompt's hidden states: mean, cls "
                "(first token) or last (last token)", "{mean,cls,last}",
                default_text="the model's sentence-transformers or GGUF setting, else last"),
    ModelOption("spec", choice(*SPEC_KINDS), "engine.spec",
                "speculative decoding: none, ngram (prompt lookup: drafts copied from "
                "where the newest tokens appeared before in the request), draft (a "
                "smaller model's guesses, --draft-model) or mtp (the checkpoint's own "
                "multi-token-prediction head: Qwen3-Next, Qwen3.5); output unchanged",
                "{none,ngram,draft,mtp}"),
    ModelOption("draft-model", model_path, "engine.draft_model",
                "with --spec draft: the draft model, a GGUF file or a Hugging Face directory "
                "with this model's vocabulary; it runs beside the model on its device",
                "PATH", is_path=True, default_text="none"),
    ModelOption("model-draft", model_path, "engine.draft_model",
                "llama.cpp's name for --draft-model", "PATH", is_path=True,
                default_text="none"),
    ModelOption("spec-draft-model", model_path, "engine.draft_model",
                "llama.cpp's newer name for --draft-model", "PATH", is_path=True,
                default_text="none"),
    ModelOption("md", model_path, "engine.draft_model",
                "llama.cpp's short name for --draft-model", "PATH", is_path=True,
                default_text="none"),
    ModelOption("draft-tokens", integer(1, 64), "engine.draft_tokens",
                "with --spec: the most draft tokens verified per request per step", "K"),
    ModelOption("draft-max", integer(1, 64), "engine.draft_tokens",
                "llama.cpp's name for --draft-tokens", "K"),
    ModelOption("spec-draft-n-max", integer(1, 64), "engine.draft_tokens",
                "llama.cpp's newer name for --draft-tokens", "K"),
    ModelOption("draft-n", integer(1, 64), "engine.draft_tokens",
                "llama.cpp's older name for --draft-tokens", "K"),
    ModelOption("draft", integer(1, 64), "engine.draft_tokens",
                "llama.cpp's oldest name for --draft-tokens", "K"),
    ModelOption("spec-ngram-min", integer(1, 16), "engine.spec_ngram_min",
                "with --spec ngram: the shortest run of newest tokens looked up", "N"),
    ModelOption("spec-ngram-max", integer(1, 16), "engine.spec_ngram_max",
                "with --spec ngram: the longest run of newest tokens looked up (tried first)",
                "N"),
    ModelOption("expert-residency", choice(*EXPERT_RESIDENCIES), "engine.expert_residency",
                "where a mixture-of-experts model's routed experts stay: device, or host "
                "(page-locked host memory the GPU reads the selected experts from; attention, "
                "dense layers and routers stay on the device)", "{device,host}"),
    ModelOption("cpu-moe", cpu_moe, "engine.expert_residency",
                "llama.cpp's switch for --expert-residency host", flag=True,
                default_text="false"),
    ModelOption("cmoe", cpu_moe, "engine.expert_residency",
                "llama.cpp's short name for --cpu-moe", flag=True, default_text="false"),
    ModelOption("n-cpu-moe", integer(0), "engine.host_expert_layers",
                "llama.cpp's: the routed experts of the first N layers in host memory, the "
                "rest on the device (0: none)", "N"),
    ModelOption("ncmoe", integer(0), "engine.host_expert_layers",
                "llama.cpp's short name for --n-cpu-moe", "N"),
    ModelOption("expert-cache-mib", integer(0), "engine.expert_cache_mib",
                "device memory (MiB) for a cache of recently used host-resident experts "
                "(0: none)", "MIB"),
    ModelOption("moe-cache-mib", integer(0), "engine.expert_cache_mib",
                "llama.cpp's name for --expert-cache-mib", "MIB"),
    ModelOption("ctx-checkpoints", integer(0), "engine.ctx_checkpoints",
                "hybrid models (Qwen3-Next, Qwen3.5): recurrent-state checkpoints kept per "
                "slot, from which a prompt that repeats a cached prefix resumes (0: none, "
                "so such prefixes are computed again)", "N"),
    ModelOption("swa-checkpoints", integer(0), "engine.ctx_checkpoints",
                "llama.cpp's older name for --ctx-checkpoints", "N"),
    ModelOption("checkpoint-every-n-tokens", integer(-1), "engine.checkpoint_every_n_tokens",
                "hybrid models: a recurrent-state checkpoint every N prompt tokens of a "
                "long prompt's prefill (-1 or 0: only at a prompt's end and where a "
                "request stops)", "N"),
    ModelOption("cpent", integer(-1), "engine.checkpoint_every_n_tokens",
                "llama.cpp's short name for --checkpoint-every-n-tokens", "N"),
    ModelOption("seed", integer(-1, 2**64 - 1), "sampling.seed",
                "seed of requests that bring none, so repeated requests reproduce "
                "(-1: a random seed per request)", "N", default_text="-1"),
    ModelOption("temp", number(0.0, 2.0), "sampling.temperature",
                "default temperature for requests that set none", "T"),
    ModelOption("top-k", integer(-1), "sampling.top_k",
                "default top_k for requests that set none (0 or -1: off)", "K"),
    ModelOption("top-p", number(0.0, 1.0, low_open=True), "sampling.top_p",
                "default top_p for requests that set none", "P"),
    ModelOption("min-p", number(0.0, 1.0), "sampling.min_p",
                "default min_p for requests that set none", "P"),
    ModelOption("chat-template", template_file, "chat_template",
                "a Jinja chat template file that replaces the model's own", "FILE",
                is_path=True, default_text="the model's template"),
    ModelOption("chat-template-file", template_file, "chat_template",
                "llama.cpp's name for --chat-template", "FILE",
                is_path=True, default_text="the model's template"),
    ModelOption("chat-template-kwargs", template_kwargs, "chat_template_kwargs",
                "template variables as a JSON object, e.g. '{\"enable_thinking\": false}'; "
                "a request's chat_template_kwargs override them", "JSON", default_text="{}"),
    ModelOption("reasoning-budget", integer(-1), "reasoning_budget",
                "reasoning tokens a thinking model may write before the engine ends its "
                "block, for requests that name no budget or effort (-1: no limit, 0: "
                "thinking off)", "N"),
    ModelOption("model-suspend", boolean, "model_suspend",
                "to make room under --models-max, put this model to sleep instead of "
                "unloading it", flag=True),
    ModelOption("suspend-weights", choice("host", "disk"), "suspend_weights",
                "where a sleeping model's weights wait: host (pinned memory, fast wake) "
                "or disk (read again on wake)", "WHERE"),
    ModelOption("sleep-idle-seconds", number(0.0), "sleep_idle_seconds",
                "put the model to sleep after this many seconds without requests (0: never)", "S"),
    ModelOption("unload-idle-seconds", number(0.0), "unload_idle_seconds",
                "unload the model after this many seconds without requests (0: never)", "S"),
    ModelOption("load-timeout", number(0.0, low_open=True), "load_timeout",
                "seconds a load or wake may take before it counts as failed", "S"),
    ModelOption("stop-timeout", number(0.0), "stop_timeout",
                "seconds an engine gets to exit after shutdown before it is terminated", "S"),
    ModelOption("load-on-startup", boolean, "load_on_startup",
                "load the model when the router starts", flag=True, section_only=True),
    ModelOption("alias", names, "aliases",
                "other names requests may use for the model (a, b)", section_only=True),
    ModelOption("tags", names, "tags",
                "labels listed in the model's /models card (a, b); they do not affect routing",
                "TAGS"),
    ModelOption("reranking", boolean, "reranking",
                "serve POST /rerank with this model as a yes/no relevance judge "
                "(Qwen3-Reranker's prompt; docs/llamacpp.md)", flag=True),
    ModelOption("rerank", boolean, "reranking", "llama.cpp's short name for --reranking",
                flag=True),
    ModelOption("slot-save-path", directory, "slot_save_path",
                "directory where POST /slots/{id}?action=save writes a lane's KV session and "
                "action=restore reads it (llama.cpp's; off: those actions are refused)", "DIR",
                is_path=True, default_text="off"),
    ModelOption("slots", boolean, "slots_endpoint",
                "serve GET /slots, each lane's state (llama.cpp's --slots; --no-slots: off)",
                flag=True),
)

BY_NAME: Mapping[str, ModelOption] = {option.name: option for option in OPTIONS}

# Options of the router as a whole: refused in a preset, which configures models.
ROUTER_OPTIONS = frozenset({
    "host", "port", "models-dir", "models-preset", "models-max", "models-autoload",
    "devices", "device-headroom-mib",
    "no-models-autoload", "pending-timeout-ms", "shutdown-grace-seconds", "log-level",
    "response-store-max-records", "response-store-max-mib",
    "api-key", "api-key-file", "metrics-open", "cors", "max-request-mib", "max-pending-requests",
    "max-token-count-requests", "default-max-tokens", "request-log-jsonl", "request-log-max-mib",
    "request-log-keep", "log-stats-interval-ms", "max-choices",
    "cors-origins", "allowed-host", "http-header-timeout-ms", "http-body-timeout-ms",
    "http-keepalive-timeout-ms", "max-connections", "webui", "no-webui",
    "media-max-bytes", "media-fetch-timeout", "media-max-images", "media-max-image-tokens",
    "media-allow-private-urls",
})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every command-line option of the table, each defaulting to None so
    that `given_options` knows what the command line really said."""
    group = parser.add_argument_group(
        "per-model options (they override the preset's [*] and model sections)")
    for option in OPTIONS:
        if option.section_only:
            continue
        if option.flag:
            group.add_argument(f"--{option.name}", dest=option.dest, default=None,
                               action=argparse.BooleanOptionalAction,
                               help=f"{option.help} (default: {describe_default(option)})")
        else:
            group.add_argument(f"--{option.name}", dest=option.dest, default=None,
                               type=_argparse_type(option), metavar=option.metavar,
                               help=f"{option.help} (default: {describe_default(option)})")


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The per-model options the command line gave, by option name. A
    switch's value goes through its parser, as in a preset (--cpu-moe gives
    an expert residency, not a bool)."""
    return {
        option.name: option.parse("true" if value else "false") if option.flag else value
        for option in OPTIONS
        if not option.section_only and (value := getattr(args, option.dest, None)) is not None
    }


def resolve_settings(layers: Iterable[Mapping[str, Any]]) -> ModelSettings:
    """ModelSettings from option layers (name -> parsed value), lowest
    precedence first; what no layer gives keeps its built-in default.

    Raises ValueError for an unknown option name or a combination that
    EngineOptions refuses (e.g. max-batched-tokens below max-concurrency)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for name, value in layer.items():
            # Moved to the end: of two names for one field (cpu-moe, cmoe),
            # the later layer's wins below whichever layer named it first.
            merged.pop(name, None)
            merged[name] = value
    engine: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for name, value in merged.items():
        option = BY_NAME.get(name)
        if option is None:
            raise ValueError(f"unknown option {name!r}")
        group, _, field_name = option.target.rpartition(".")
        {"engine": engine, "sampling": sampling, "": fields}[group][field_name] = value
    return ModelSettings(engine=EngineOptions(**engine), sampling=SamplingOverrides(**sampling),
                         **fields)


def _argparse_type(option: ModelOption) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except OptionValueError as exc:
            # argparse prints this message after the option's name.
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = option.name
    return parse


def describe_default(option: ModelOption) -> str:
    if option.default_text is not None:
        return option.default_text
    if option.default is None:
        # Only the sampling defaults are unset: they fall through to the model.
        return "the model's generation_config.json, else llama.cpp's"
    if option.flag:
        return "true" if option.default else "false"
    if option.default == ():
        return "none"
    return str(option.default)
