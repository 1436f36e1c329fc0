"""A /completion request's sampling fields: checked, turned into the shared
SamplingRequest (router/sampling.py), and reported back as llama.cpp's
`generation_settings`.

Sampler controls the engine lacks (mirostat, DRY, XTC, typical-p, ...) are
accepted at their neutral values, which llama.cpp's own defaults are, and
refused otherwise with 400 `<field>_not_supported`: silently sampling
differently from what a client asked for would be worse than saying so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol import MAX_TOP_LOGPROBS, SamplingParams
from router.http.errors import ApiError, invalid
from router.llamacpp.schemas import CompletionRequest
from router.sampling import SamplingRequest
from router.text.stop_strings import check_stops

# llama.cpp reports "no seed" as LLAMA_DEFAULT_SEED, -1 as an unsigned 32-bit value.
DEFAULT_SEED = 0xFFFFFFFF

# llama.cpp's sampler chain, in its default order, by canonical name.
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                    "temperature")
# adaptive_p does nothing unless adaptive_target is set, which is refused.
_SAMPLER_NAMES = {name: name for name in (*DEFAULT_SAMPLERS, "adaptive_p")} | {
    "typical_p": "typ_p", "typical": "typ_p", "nucleus": "top_p", "temp": "temperature"}
# The one-letter form (--sampler-seq, and what llama.cpp's WebUI sends).
_SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
                  "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature"}
# The samplers the engine implements; the others are neutral in any request
# that gets this far, so where they stand in the chain changes nothing.
_ENGINE_SAMPLERS = ("penalties", "top_k", "top_p", "min_p", "temperature")


def logit_biases(value: list[Any] | dict[str, Any] | None) -> dict[int, float]:
    """llama.cpp's logit_bias, [[token, bias], ...] or {"token": bias}, as
    {token id: bias}; a bias of false bans the token (-inf). Tokens given as
    text are refused: send their ids (POST /tokenize gives them)."""
    if not value:
        return {}
    if isinstance(value, dict):
        entries = list(value.items())
    else:
        if not all(isinstance(e, list) and len(e) == 2 for e in value):
            raise invalid("'logit_bias' is [[token, bias], ...] or {\"token\": bias}", "logit_bias")
        entries = [(e[0], e[1]) for e in value]
    biases: dict[int, float] = {}
    for token, bias in entries:
        if isinstance(token, str):
            try:
                token = int(token)
            except ValueError:
                raise not_supported("logit_bias", "'logit_bias' takes token ids here, not text; "
                                    "POST /tokenize gives a text's ids") from None
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise invalid(f"'logit_bias' token {token!r} is not a token id", "logit_bias")
        if bias is False:
            biases[token] = float("-inf")
        elif isinstance(bias, int | float) and not isinstance(bias, bool) and math.isfinite(bias):
            if bias:
                biases[token] = float(bias)
        else:
            raise invalid(f"'logit_bias' bias for token {token} must be a number or false",
                          "logit_bias")
    return biases


# (field, is the request neutral in it, the neutral value to name in the error).
# Some fields only matter when another one turns their sampler on.
_NEUTRAL: tuple[tuple[str, Callable[[CompletionRequest], bool], str], ...] = (
    ("dynatemp_range", lambda r: r.dynatemp_range <= 0, "0"),
    ("dynatemp_exponent", lambda r: r.dynatemp_range <= 0 or r.dynatemp_exponent == 1, "1"),
    ("top_n_sigma", lambda r: r.top_n_sigma <= 0, "-1"),
    ("xtc_probability", lambda r: r.xtc_probability <= 0, "0"),
    ("xtc_threshold", lambda r: r.xtc_probability <= 0 or r.xtc_threshold > 0.5, "0.1"),
    ("typical_p", lambda r: r.typical_p >= 1, "1"),
    ("mirostat", lambda r: r.mirostat == 0, "0"),
    ("mirostat_tau", lambda r: r.mirostat == 0, "5"),
    ("mirostat_eta", lambda r: r.mirostat == 0, "0.1"),
    ("dry_multiplier", lambda r: r.dry_multiplier <= 0, "0"),
    ("dry_base", lambda r: r.dry_multiplier <= 0, "1.75"),
    ("dry_allowed_length", lambda r: r.dry_multiplier <= 0, "2"),
    ("dry_penalty_last_n", lambda r: r.dry_multiplier <= 0, "-1"),
    ("dry_sequence_breakers", lambda r: r.dry_multiplier <= 0, "the default"),
    ("adaptive_target", lambda r: r.adaptive_target < 0, "-1"),
    ("min_keep", lambda r: r.min_keep <= 1, "0"),
    ("n_indent", lambda r: r.n_indent <= 0, "0"),
    ("t_max_predict_ms", lambda r: r.t_max_predict_ms <= 0, "0"),
    ("lora", lambda r: all(isinstance(a, dict) and a.get("scale", 0) == 0 for a in r.lora or ()), "[]"),
    ("n_cmpl", lambda r: r.n_cmpl in (None, 1), "1"),
    ("n", lambda r: r.n in (None, 1), "1"),
    ("grammar_lazy", lambda r: not r.grammar_lazy, "false"),
)


# llama.cpp's default penalty window.
DEFAULT_REPEAT_LAST_N = 64
# A window wider than any context: llama.cpp's -1, "the whole context".
WHOLE_CONTEXT = 1 << 30


def penalty_window(repeat_last_n: int | None) -> int:
    """SamplingParams.penalty_last_n for llama.cpp's repeat_last_n (0 turns the
    penalties off before this is asked)."""
    if repeat_last_n is None:
        return DEFAULT_REPEAT_LAST_N
    return WHOLE_CONTEXT if repeat_last_n == -1 else max(repeat_last_n, 1)


def not_supported(field: str, message: str) -> ApiError:
    return ApiError(400, message, type="not_supported_error", code=f"{field}_not_supported",
                    param=field)


def check_neutral(req: CompletionRequest) -> None:
    for field, neutral, value in _NEUTRAL:
        if not neutral(req):
            raise not_supported(field, f"'{field}' is not supported by this server; only its "
                                f"neutral value ({value}) is accepted")


def sampler_chain(samplers: list[str] | str | None) -> tuple[str, ...]:
    """The chain a request names, as canonical names (llama.cpp's default if none)."""
    if samplers is None:
        return DEFAULT_SAMPLERS
    if isinstance(samplers, str):
        unknown = [c for c in samplers if c not in _SAMPLER_CHARS]
        if unknown:
            raise invalid(f"unknown sampler letter {unknown[0]!r} in 'samplers'", "samplers")
        chain = tuple(_SAMPLER_CHARS[c] for c in samplers)
    else:
        unknown = [name for name in samplers if name not in _SAMPLER_NAMES]
        if unknown:
            raise invalid(f"unknown sampler {unknown[0]!r} in 'samplers'; known: "
                          f"{', '.join(DEFAULT_SAMPLERS)}", "samplers")
        chain = tuple(_SAMPLER_NAMES[name] for name in samplers)
    ours = [name for name in chain if name in _ENGINE_SAMPLERS]
    if ours != sorted(set(ours), key=_ENGINE_SAMPLERS.index):
        raise not_supported("samplers", "'samplers' may leave samplers out but not reorder or "
                            f"repeat them: {', '.join(_ENGINE_SAMPLERS)} run in this order")
    return chain


@dataclass(frozen=True)
class CompletionSettings:
    """A checked /completion request: what the engine gets and what the
    response reports."""

    sampling: SamplingRequest
    chain: tuple[str, ...]
    # -1: until the context ends; 0: evaluate the prompt only.
    n_predict: int


def _finite(value: float | None, name: str) -> None:
    if value is not None and not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number, got {value}", name)


def completion_settings(req: CompletionRequest) -> CompletionSettings:
    check_neutral(req)
    chain = sampler_chain(req.samplers)
    for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                 "frequency_penalty"):
        _finite(getattr(req, name), name)
    if req.top_p is not None and req.top_p <= 0:
        raise invalid(f"'top_p' must be greater than 0, got {req.top_p}", "top_p")
    if req.min_p is not None and not 0 <= req.min_p <= 1:
        raise invalid(f"'min_p' must be in [0, 1], got {req.min_p}", "min_p")
    if req.repeat_penalty is not None and req.repeat_penalty <= 0:
        raise invalid(f"'repeat_penalty' must be greater than 0, got {req.repeat_penalty}",
                      "repeat_penalty")
    if req.seed is not None and req.seed < -1:
        raise invalid(f"'seed' must be -1 (random) or a non-negative number, got {req.seed}", "seed")
    n_predict = next((v for v in (req.n_predict, req.max_completion_tokens, req.max_tokens)
                      if v is not None), -1)
    # llama.cpp takes a list; one string is read as a list of one.
    stop = check_stops([req.stop] if isinstance(req.stop, str) else req.stop or [], "stop")
    penalties = "penalties" in chain and req.repeat_last_n != 0
    if req.repeat_last_n is not None and req.repeat_last_n < -1:
        raise invalid(f"'repeat_last_n' must be -1 (the whole context), 0 (off) or a count, "
                      f"got {req.repeat_last_n}", "repeat_last_n")
    temperature = req.temperature
    if temperature is not None and temperature < 0:
        temperature = 0.0  # llama.cpp: a negative temperature samples greedily
    # llama.cpp reads top_p >= 1 as "off"; the engine wants at most 1.
    top_p = min(req.top_p, 1.0) if req.top_p is not None else None
    sampling = SamplingRequest(
        # A sampler left out of the chain does not run: the same as its "off"
        # value (without a temperature sampler llama.cpp draws at 1.0).
        temperature=temperature if "temperature" in chain else 1.0,
        top_k=req.top_k if "top_k" in chain else 0,
        top_p=top_p if "top_p" in chain else 1.0,
        min_p=req.min_p if "min_p" in chain else 0.0,
        repetition_penalty=(req.repeat_penalty or 1.0) if penalties else 1.0,
        presence_penalty=(req.presence_penalty or 0.0) if penalties else 0.0,
        frequency_penalty=(req.frequency_penalty or 0.0) if penalties else 0.0,
        penalty_last_n=penalty_window(req.repeat_last_n),
        seed=None if req.seed in (None, -1, DEFAULT_SEED) else req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
        report_progress=req.return_progress and req.stream,
        logit_bias=logit_biases(req.logit_bias),
        # n_probs: each generated token's probability and its n_probs most
        # likely alternatives (at most MAX_TOP_LOGPROBS), from the raw
        # distribution or, with post_sampling_probs, the one it was drawn from.
        logprobs=min(req.n_probs, MAX_TOP_LOGPROBS) if req.n_probs > 0 else -1,
        logprobs_mode="processed" if req.post_sampling_probs else "raw",
        cache_prompt=req.cache_prompt,
    )
    return CompletionSettings(sampling, chain, n_predict if n_predict >= 0 else -1)


def reported_seed(request_seed: int | None, configured: int) -> int:
    """The seed llama.cpp reports: the request's, else the server's --seed,
    with "a random one per request" (-1) as LLAMA_DEFAULT_SEED."""
    if request_seed is not None:
        return request_seed
    return configured if configured >= 0 else DEFAULT_SEED


def generation_settings(r: CompletionRequest, settings: CompletionSettings,
                        params: SamplingParams, configured_seed: int = -1) -> dict[str, Any]:
    """llama.cpp's `generation_settings` (and /props' default params): the
    values in effect, with the neutral values of what the engine lacks.
    configured_seed is the model's --seed (-1: random per request)."""
    n_predict = settings.n_predict
    return {
        "seed": reported_seed(settings.sampling.seed, configured_seed),
        "temperature": params.temperature,
        "dynatemp_range": r.dynatemp_range,
        "dynatemp_exponent": r.dynatemp_exponent,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "top_n_sigma": r.top_n_sigma,
        "xtc_probability": r.xtc_probability,
        "xtc_threshold": r.xtc_threshold,
        "typical_p": r.typical_p,
        "repeat_last_n": r.repeat_last_n if r.repeat_last_n is not None else DEFAULT_REPEAT_LAST_N,
        "repeat_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "dry_multiplier": r.dry_multiplier,
        "dry_base": r.dry_base,
        "dry_allowed_length": r.dry_allowed_length,
        "dry_penalty_last_n": r.dry_penalty_last_n,
        "dry_sequence_breakers": r.dry_sequence_breakers or ["\n", ":", "\"", "*"],
        "mirostat": r.mirostat,
        "mirostat_tau": r.mirostat_tau,
        "mirostat_eta": r.mirostat_eta,
        "stop": list(settings.sampling.stop),
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "n_keep": r.n_keep,
        "n_discard": r.n_discard,
        "ignore_eos": r.ignore_eos,
        "stream": r.stream,
        # llama.cpp writes a ban as false (JSON has no -inf).
        "logit_bias": [[token, bias if math.isfinite(bias) else False]
                       for token, bias in params.logit_bias.items()],
        "n_probs": r.n_probs,
        "min_keep": r.min_keep,
        "grammar": r.grammar or "",
        "grammar_lazy": False,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": "Content-only",
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "thinking_forced_open": False,
        "samplers": list(settings.chain),
        "speculative.n_max": 16,
        "speculative.n_min": 0,
        "speculative.p_min": 0.75,
        "timings_per_token": r.timings_per_token,
        "post_sampling_probs": r.post_sampling_probs,
        "lora": [],
    }
