"""Range checks for OpenAI request fields and the SamplingRequest they become
(router/sampling.py turns that into engine SamplingParams with the defaults)."""

from __future__ import annotations

import math

from protocol import MAX_TOP_LOGPROBS
from router.http.errors import invalid
from router.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.output_budget import NO_LIMIT
from router.sampling import SamplingRequest, check_range
from router.text.stop_strings import check_stops

__all__ = ["chat_logprobs", "check_choices", "check_common", "check_max_tokens",
           "completion_logprobs", "sampling_request", "stop_strings"]

# OpenAI's bound on Completions' logprobs (Chat's top_logprobs goes to 20).
MAX_COMPLETION_LOGPROBS = 5


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return check_stops([stop] if isinstance(stop, str) else stop, "stop")


def check_common(req: SamplingFields) -> None:
    if req.n is not None and req.n < 1:
        raise invalid(f"'n' must be at least 1, got {req.n}", "n")
    check_range(req.temperature, "temperature", 0.0, 2.0)
    check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    check_range(req.min_p, "min_p", 0.0, 1.0)
    check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    check_range(req.repetition_penalty, "repetition_penalty", 0.0, 10.0, low_open=True)
    if req.top_k is not None and req.top_k < -1:
        raise invalid(f"'top_k' must be -1 or 0 (off) or a positive count, got {req.top_k}", "top_k")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise invalid("'stop_token_ids' must hold non-negative token ids", "stop_token_ids")
    if req.priority not in (None, 0):
        raise invalid("'priority' is not supported: requests are served in arrival order "
                      "(0 is accepted)", "priority", "unsupported_parameter")


# OpenAI's bounds on a logit bias.
MAX_LOGIT_BIAS = 100.0


def logit_bias(value: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias}: ids as integers, biases in [-100, 100]
    (-100 bans a token in practice, as at OpenAI). Ids are checked against the
    model's vocabulary once it is loaded (router/sampling.py)."""
    biases: dict[int, float] = {}
    for key, bias in (value or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"'logit_bias' keys are token ids, got {key!r}", "logit_bias") from None
        if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise invalid(f"'logit_bias' values must be in [-100, 100], got {bias} for token {token}",
                          "logit_bias")
        if token < 0:
            raise invalid(f"'logit_bias' names token id {token}, outside the vocabulary", "logit_bias")
        if bias:
            biases[token] = float(bias)
    return biases


def check_max_tokens(value: int | None, name: str) -> None:
    # -1: no limit but the context (llama.cpp's meaning; its web UI sends it).
    if value is not None and value < 1 and value != NO_LIMIT:
        raise invalid(f"'{name}' must be at least 1, or -1 for no limit but the context; "
                      f"got {value}", name)


def check_choices(choices: int, limit: int, param: str = "n") -> None:
    """--max-choices bounds the choices one request generates (n times the
    prompts, or best_of times the prompts)."""
    if choices > limit:
        raise invalid(f"this request asks for {choices} choices; this server generates at most "
                      f"{limit} per request (--max-choices)", param)


def chat_logprobs(req: ChatCompletionRequest) -> int:
    """SamplingRequest.logprobs for Chat's logprobs / top_logprobs (-1: none)."""
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if not req.logprobs:
        if top:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return -1
    return top or 0


def completion_logprobs(req: CompletionRequest) -> int:
    """SamplingRequest.logprobs for Completions' logprobs (-1: none)."""
    if req.logprobs is None:
        return -1
    if not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid(f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}",
                      "logprobs")
    return req.logprobs


def sampling_request(req: SamplingFields, max_tokens: int | None, *,
                     logprobs: int = -1) -> SamplingRequest:
    return SamplingRequest(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed,
        stop=stop_strings(req.stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=logit_bias(req.logit_bias),
        logprobs=logprobs,
    )
