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
    # vLLM's extensions, handy for benchmarks and tools.
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, or a one-element list of either (checked by the
    # handler: msgspec unions allow only one array type).
    prompt: str | list[Any]
    echo: bool = False
    suffix: str | None = None
