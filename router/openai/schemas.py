"""Request bodies of the OpenAI endpoints, decoded and type-checked by msgspec.

Unknown fields are ignored, as OpenAI-compatible servers do; values are range
checked in router/openai/params.py, where each error names its field.
"""

from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # Earlier thinking, handed back to templates that render it (Qwen3 does).
    reasoning_content: str | None = None
    reasoning: str | None = None
    # The legacy function-calling shape (an assistant's call), read as tool_calls.
    function_call: dict[str, Any] | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by Chat Completions and Completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # {token id (as a string): bias in [-100, 100]}, added to the logits.
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions, handy for benchmarks and tools.
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # vLLM's structured outputs (router/openai/guided.py): at most one of them.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's scheduling priority: only the default (0) is accepted.
    priority: int | None = None
    # An end-user id for abuse monitoring: accepted, without effect here.
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's legacy function calling, read as tools / tool_choice.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's: render without opening an assistant turn / continue the final
    # assistant message instead (they exclude each other).
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    # Log probabilities of the answer's tokens, with top_logprobs (0..20)
    # alternatives each (router/openai/logprobs.py).
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Accepted at their neutral values only (router/openai/chat_request.py).
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    verbosity: str | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # Reasoning tokens before the engine ends the block (-1: no limit, 0:
    # thinking off); thinking_budget_tokens is llama.cpp's name for it.
    thinking_budget: int | None = None
    thinking_budget_tokens: int | None = None
    # llama.cpp's extensions.
    enable_thinking: bool | None = None
    return_progress: bool = False
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # Timings on every streamed content chunk (llama.cpp's web UI sends it).
    timings_per_token: bool = False


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, or a list of strings or of token id lists, one
    # choice (or n) per prompt (checked by the handler: msgspec unions allow
    # only one array type).
    prompt: str | list[Any]
    echo: bool = False
    suffix: str | None = None
    # The chosen tokens' log probabilities and the 0..5 most likely tokens'.
    logprobs: int | None = None
    # Candidates generated per prompt, of which the n most likely are returned.
    best_of: int | None = None
