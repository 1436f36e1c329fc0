"""Request bodies of llama.cpp's native endpoints, decoded and type-checked by msgspec.

Field names and defaults are llama.cpp's (tools/server/README.md). Unknown
fields are ignored, as llama.cpp's server ignores them. The defaults of the
sampler controls the engine lacks are their neutral values, so a client that
sends llama.cpp's own defaults is accepted (router/llamacpp/params.py).
"""

from __future__ import annotations

from typing import Any

import msgspec


class CompletionRequest(msgspec.Struct, kw_only=True):
    # A string, token ids, a mix of both, a one-element list of those, or
    # {"prompt_string": ..., "multimodal_data": [...]} (router/llamacpp/prompt.py).
    prompt: str | list[Any] | dict[str, Any]
    model: str | None = None
    # -1: until the context ends. max_tokens and max_completion_tokens are
    # aliases llama.cpp reads when n_predict is absent.
    n_predict: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stop: list[str] | str | None = None
    cache_prompt: bool = True
    return_tokens: bool = False
    response_fields: list[str] | None = None
    timings_per_token: bool = False
    return_progress: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    # Context shifting and slot choice: no effect here (generation stops at the
    # end of the context; the prefix cache is shared by every request).
    id_slot: int = -1
    n_keep: int = 0
    n_discard: int = 0
    n_cache_reuse: int = 0
    n_cmpl: int | None = None
    n: int | None = None
    # Sampler controls the engine lacks: accepted at their neutral values only.
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    typical_p: float = 1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None
    adaptive_target: float = -1.0
    n_probs: int = 0
    min_keep: int = 0
    post_sampling_probs: bool = False
    logit_bias: list[Any] | dict[str, Any] | None = None
    samplers: list[str] | str | None = None
    n_indent: int = 0
    t_max_predict_ms: int = 0
    lora: list[Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    grammar_lazy: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    content: str
    model: str | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None
