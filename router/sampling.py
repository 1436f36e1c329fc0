"""Sampling settings shared by every API: what a request asked for, the
defaults for what it left out, and the SamplingParams sent to the engine.

When a request leaves temperature/top_p/top_k/min_p out, the value comes from,
in order: the server's command line or preset (--temp, --top-p, ...), the
model's generation_config.json (Hugging Face directories), llama.cpp's server
defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from protocol import GrammarSpec, SamplingParams
from protocol.sampling import LogprobsMode
from router.errors import invalid
from router.settings import SamplingOverrides

log = logging.getLogger(__name__)

SERVER_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = SERVER_DEFAULTS["temperature"]
    top_k: int = int(SERVER_DEFAULTS["top_k"])
    top_p: float = SERVER_DEFAULTS["top_p"]
    min_p: float = SERVER_DEFAULTS["min_p"]
    # --seed: the seed of requests that bring none; -1 draws a fresh random
    # seed per request (llama.cpp's default).
    seed: int = -1

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


@dataclass(frozen=True)
class SamplingRequest:
    """What a request asked for, in any API's terms; None leaves a choice to
    the defaults (max_tokens None or -1: router/output_budget.py decides)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # 0: OpenAI's penalty rule; N > 0: the last N tokens (llama.cpp's repeat_last_n).
    penalty_last_n: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    report_progress: bool = False
    # token id -> bias added to its logit (-inf bans it); checked against the
    # vocabulary by build_params.
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    # -1: none; N >= 0: each generated token's log probability and its N most
    # likely alternatives (prompt_logprobs: the same for the prompt's tokens).
    logprobs: int = -1
    prompt_logprobs: int = -1
    # "raw": the model's own distribution; "processed": the one each token was
    # drawn from (llama.cpp's post_sampling_probs; protocol SamplingParams).
    logprobs_mode: LogprobsMode = "raw"
    # False: the request neither reuses the prefix cache nor adds to it
    # (llama.cpp's cache_prompt; protocol SamplingParams).
    cache_prompt: bool = True


def resolve_seed(seed: int | None, defaults: SamplingDefaults) -> int:
    """The request's seed, else the configured one, else a fresh random one:
    every request samples from its own stream, so its tokens never depend on
    what ran before it (streamed and not streamed alike)."""
    if seed is not None:
        return seed
    if defaults.seed >= 0:
        return defaults.seed
    return secrets.randbits(64)


def check_logit_bias(bias: Mapping[int, float], n_vocab: int, param: str = "logit_bias") -> None:
    bad = next((token for token in bias if not 0 <= token < n_vocab), None)
    if bad is not None:
        raise invalid(f"'{param}' names token id {bad}, outside this model's vocabulary "
                      f"(0..{n_vocab - 1})", param)


def check_range(value: float | None, name: str, low: float, high: float, *, low_open: bool = False) -> None:
    """A 400 naming the field when value is outside [low, high] (or (low, high])."""
    if value is None:
        return
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise invalid(f"'{name}' must be in {bracket}{low}, {high}], got {value}", name)


def build_params(
    request: SamplingRequest,
    *,
    max_tokens: int,
    defaults: SamplingDefaults,
    eos_token_ids: tuple[int, ...],
    grammar: GrammarSpec | None = None,
    n_vocab: int | None = None,
) -> SamplingParams:
    """n_vocab (the loaded model's vocabulary size) checks logit_bias ids."""
    if n_vocab is not None:
        check_logit_bias(request.logit_bias, n_vocab)
    top_k = request.top_k if request.top_k is not None else defaults.top_k
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature if request.temperature is not None else defaults.temperature,
        top_p=request.top_p if request.top_p is not None else defaults.top_p,
        top_k=max(top_k, 0),
        min_p=request.min_p if request.min_p is not None else defaults.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        penalty_last_n=request.penalty_last_n,
        seed=resolve_seed(request.seed, defaults),
        # The model's end tokens stop generation unless the client asked to
        # ignore them (benchmarks do).
        stop_token_ids=sorted(
            set(request.stop_token_ids) | (set() if request.ignore_eos else set(eos_token_ids))
        ),
        ignore_eos=request.ignore_eos,
        grammar=grammar,
        report_progress=request.report_progress,
        logit_bias=dict(request.logit_bias),
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        logprobs_mode=request.logprobs_mode,
        cache_prompt=request.cache_prompt,
    )
