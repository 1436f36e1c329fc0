"""Range checks for OpenAI request fields and the SamplingParams they become.

When a request leaves temperature/top_p/top_k/min_p out, the value comes from,
in order: the server's command line (--temp, --top-p, ...), the model's
generation_config.json (Hugging Face directories), llama.cpp's server defaults
(temperature 0.8, top_k 40, top_p 0.95, min_p 0.05).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from protocol import SamplingParams
from router.http.errors import invalid
from router.openai.schemas import SamplingFields
from router.settings import SamplingOverrides

log = logging.getLogger(__name__)

SERVER_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = SERVER_DEFAULTS["temperature"]
    top_k: int = int(SERVER_DEFAULTS["top_k"])
    top_p: float = SERVER_DEFAULTS["top_p"]
    min_p: float = SERVER_DEFAULTS["min_p"]

    @classmethod
    def for_model(cls, model_path: Path, overrides: SamplingOverrides) -> SamplingDefaults:
        defaults = cls.from_generation_config(model_path)
        given = {name: value for name, value in vars(overrides).items() if value is not None}
        return replace(defaults, **given)

    @classmethod
    def from_generation_config(cls, model_path: Path) -> SamplingDefaults:
        """Read a Hugging Face generation_config.json, if the model has one."""
        directory = model_path if model_path.is_dir() else model_path.parent
        config_file = directory / "generation_config.json"
        if not config_file.is_file():
            return cls()
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", config_file, exc)
            return cls()
        if not config.get("do_sample", True):
            return cls(temperature=0.0)
        base = cls()
        return cls(
            temperature=float(config.get("temperature", base.temperature)),
            top_k=int(config.get("top_k", base.top_k)),
            top_p=float(config.get("top_p", base.top_p)),
            min_p=float(config.get("min_p", base.min_p)),
        )


def _check_range(value: float | None, name: str, low: float, high: float,
                 low_open: bool = False) -> None:
    if value is None:
        return
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise invalid(f"'{name}' must be in {bracket}{low}, {high}], got {value}", name)


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)


def check_common(req: SamplingFields) -> None:
    if req.n is not None and req.n != 1:
        raise invalid(f"'n' must be 1: this server returns one choice per request, got {req.n}", "n")
    _check_range(req.temperature, "temperature", 0.0, 2.0)
    _check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    _check_range(req.min_p, "min_p", 0.0, 1.0)
    _check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(req.repetition_penalty, "repetition_penalty", 0.0, 10.0, low_open=True)
    if req.top_k is not None and req.top_k < -1:
        raise invalid(f"'top_k' must be -1 or 0 (off) or a positive count, got {req.top_k}", "top_k")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise invalid("'stop_token_ids' must hold non-negative token ids", "stop_token_ids")


def check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 1:
        raise invalid(f"'{name}' must be at least 1, got {value}", name)


def build_sampling(
    req: SamplingFields,
    *,
    max_tokens: int,
    defaults: SamplingDefaults,
    eos_token_ids: tuple[int, ...],
) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None else defaults.top_k
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature if req.temperature is not None else defaults.temperature,
        top_p=req.top_p if req.top_p is not None else defaults.top_p,
        top_k=max(top_k, 0),
        min_p=req.min_p if req.min_p is not None else defaults.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed,
        # The model's end tokens stop generation unless the client asked to
        # ignore them (benchmarks do).
        stop_token_ids=sorted(
            set(req.stop_token_ids or ()) | (set() if req.ignore_eos else set(eos_token_ids))
        ),
        ignore_eos=req.ignore_eos,
    )
