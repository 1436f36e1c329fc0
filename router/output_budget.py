"""How many tokens a request may generate, and the refusals that go with it.

    fits(prompt_tokens, asked, max_context, api=...)   # at admission: 400 or nothing
    output_budget(max_context, prompt_tokens, asked, default_max_tokens)

- A prompt that leaves no room for one token is refused (context_length_exceeded)
  on every API.
- An explicit limit that does not fit beside the prompt is refused on the
  OpenAI APIs (Chat Completions, Completions, Responses), as OpenAI and vLLM
  do. Anthropic's and llama.cpp's routes pass clamp=True: Anthropic's API
  (Sonnet 4.5 on) lets max_tokens pass the context and stops there with
  stop_reason "model_context_window_exceeded", and its clients (Claude Code
  among them) send limits such as 32,000 whatever the model; llama.cpp
  clamps to the context.
- NO_LIMIT (-1, llama.cpp's n_predict / max_tokens for "until the context is
  full") and a request that names no limit get the context left after the
  prompt, or --default-max-tokens within it. The engine's scheduler copes
  with KV pressure by preemption, so a lone request may use the whole context.

The checks run in the lease's on_admit hook, before the wait for a lane, so
an impossible request is answered at once however busy the model is.
"""

from __future__ import annotations

from router.errors import ContextLengthExceeded

NO_LIMIT = -1


def check_prompt(prompt_tokens: int, max_context: int, param: str | None) -> None:
    """OpenAI's context_length_exceeded when the prompt leaves no room for
    even one generated token."""
    if prompt_tokens >= max_context:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"request has {prompt_tokens} input tokens, which leaves no room for output. "
            "Please reduce the length of the input.",
            n_prompt_tokens=prompt_tokens, n_ctx=max_context, param=param,
        )


def fits(prompt_tokens: int, asked: int | None, max_context: int, *, param: str | None,
         limit_field: str = "max_tokens", clamp: bool = False) -> None:
    """Refuse a prompt with no room for output, and (unless clamp) an
    explicit output limit that the context cannot hold beside the prompt."""
    check_prompt(prompt_tokens, max_context, param)
    if clamp or asked is None or asked == NO_LIMIT or prompt_tokens + asked <= max_context:
        return
    raise ContextLengthExceeded(
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{prompt_tokens + asked} tokens ({prompt_tokens} in the input, {asked} in the "
        f"completion). Please reduce the length of the input or '{limit_field}'.",
        n_prompt_tokens=prompt_tokens, n_ctx=max_context, param=param)


def output_budget(max_context: int, prompt_tokens: int, asked: int | None,
                  default_max_tokens: int = 0) -> int:
    """max_tokens for the engine: what was asked (clamped to the context left,
    which the refusals above make a no-op where they apply), else
    --default-max-tokens, else the whole context left; at least 1."""
    room = max(max_context - prompt_tokens, 1)
    if asked is not None and asked != NO_LIMIT:
        return max(min(asked, room), 1)
    if asked is None and default_max_tokens:
        return min(default_max_tokens, room)
    return room
